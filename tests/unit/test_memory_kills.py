"""Ray's memory-monitor reports cut to one line (cluster/memory_kills.py).

The reports are written here from the format strings in Ray 2.60's raylet binary (``strings
raylet``: "%d worker(s) were killed due to the node running low on memory. %s", "Memory on the
node (IP: %s, ID: %s) was %sGB used / %sGB limit (%f)", "Memory usage %dB exceeded threshold of
%dB (%.1f%% of %dB limit)", "%s%spid=%d, actual memory used=%sGB, worker ID=%s)") and from the
pre-2.56 example in Ray's docs: a test double for a node actually running out of memory."""

from treegrpo_ray.cluster.memory_kills import memory_kill_line, short_failure

RAY_2_60 = (
    "ray.exceptions.OutOfMemoryError: 2 worker(s) were killed due to the node running low on "
    "memory. Memory on the node (IP: 127.0.0.1, ID: 3a4b) was 22.91GB used / 24.00GB limit "
    "(0.954583)\nOOM kill reason: Memory usage 22910000000B exceeded threshold of 22800000000B "
    "(95.0% of 24000000000B limit)\nObject store memory usage: [- objects spillable: 0]\n"
    "Ray killed 2 worker(s) based on the killing policy\nConsidered workers: [\n"
    "(Actor(ab12): RolloutWorker.run_lease, pid=812, actual memory used=30.10GB, worker ID=77)\n"
    "]\nSelected to kill: (Actor(cd34): RolloutWorker.run_lease, pid=411, actual memory "
    "used=19.52GB, worker ID=9f), (Task: job ID=01, pid=412, actual memory used=0.31GB, "
    "worker ID=a0)\nRefer to the documentation on how to address the out of memory issue."
)
RAY_2_5X = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.62.231"
    ", ID: e5d9) where the task (task ID: 4353, name=allocate_memory, pid=11362, memory used="
    "1.25GB) was running was 27.71GB / 28.80GB (0.962273), which exceeds the memory usage "
    "threshold of 0.95. Ray killed this worker (ID: 6f2e) because it was the most recently "
    "scheduled task"
)


def test_ray_2_60_report_in_one_line_with_the_killed_workers_figures():
    line = memory_kill_line(RAY_2_60)
    assert line is not None and "\n" not in line
    assert "killed 2 worker(s)" in line
    assert "22.9 of 24.0 GB, 95%, its kill threshold 95%" in line
    assert "(pid 411) held 19.52 GB" in line  # selected, not the larger one only considered
    assert "engine.max_kv_bytes" in line and "treegrpo plan" in line


def test_older_report_and_what_came_before_it_are_kept():
    line = memory_kill_line(RAY_2_5X)
    assert line is not None
    assert "27.7 of 28.8 GB, 96%, its kill threshold 95%" in line
    assert "(pid 11362) held 1.25 GB" in line
    short = short_failure("rollout failed: " + RAY_2_60)
    assert short.startswith("rollout failed: Ray's memory monitor killed 2 worker(s)")
    assert "\n" not in short and "Object store" not in short


def test_other_failures_pass_unchanged():
    text = "rollout failed: ValueError: a malformed row\n  at line 3"
    assert memory_kill_line(text) is None
    assert short_failure(text) == text
