"""The step records: held back while their evaluation runs, written in step order, rewound."""

import json

from treegrpo_ray.cluster.metrics_log import MetricsLog


def _steps_on_disk(log: MetricsLog) -> list[dict]:
    return [json.loads(line) for line in log.path.read_text().splitlines()]


def test_a_held_record_holds_back_the_later_ones_until_its_evaluation_completes(tmp_path):
    log = MetricsLog(tmp_path)
    log.add(1, {"loss": 1.0})
    second = {"loss": 2.0}
    log.add(2, second, ready=False)  # evaluation running
    log.add(3, {"loss": 3.0})
    assert [r["step"] for r in _steps_on_disk(log)] == [1]

    log.complete(2, second, {"eval/greedy_em": 0.5})
    assert _steps_on_disk(log) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0, "eval/greedy_em": 0.5},
        {"step": 3, "loss": 3.0},
    ]
    assert log.records == _steps_on_disk(log) and not log.pending


def test_an_evaluation_of_a_rewound_step_is_dropped(tmp_path):
    log = MetricsLog(tmp_path)
    log.add(1, {"loss": 1.0})
    lost = {"loss": 2.0}
    log.add(2, lost, ready=False)
    log.rewind(1)  # a learner restarted from its step-1 checkpoint
    redone = {"loss": 2.5}
    log.add(2, redone, ready=False)

    log.complete(2, lost, {"eval/greedy_em": 0.1})  # the evaluation of the lost version
    assert [r["step"] for r in _steps_on_disk(log)] == [1]
    log.complete(2, redone, {"eval/greedy_em": 0.7})
    assert _steps_on_disk(log)[-1] == {"step": 2, "loss": 2.5, "eval/greedy_em": 0.7}
