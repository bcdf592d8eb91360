"""Typed job configuration: ``schema`` (every section and field, documented once), ``loading``
(presets, YAML files, ``a.b=value`` overrides, validation) and ``resume`` (the run's saved config
and the changes a resumed run may make). Imports no torch."""

from treegrpo_ray.config.loading import apply_override, load_config, preset_names
from treegrpo_ray.config.resume import (
    RESUMABLE_CHANGES,
    RUN_CONFIG_FILE,
    resume_config,
    save_run_config,
)
from treegrpo_ray.config.schema import (
    VLLM_CPU_BLOCK_SIZE,
    ClusterConfig,
    DepthDecayConfig,
    EngineConfig,
    JobConfig,
    LoraSettings,
    ModelConfig,
    ModifiersConfig,
    PPOConfig,
    SamplingConfig,
    TaskConfig,
    TinyModelConfig,
    TrainConfig,
    TreeConfig,
    VLLMConfig,
    WarmStartConfig,
    installed_vllm_build,
    node_memory_bytes,
)

__all__ = [
    "RESUMABLE_CHANGES",
    "RUN_CONFIG_FILE",
    "VLLM_CPU_BLOCK_SIZE",
    "ClusterConfig",
    "DepthDecayConfig",
    "EngineConfig",
    "JobConfig",
    "LoraSettings",
    "ModelConfig",
    "ModifiersConfig",
    "PPOConfig",
    "SamplingConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TrainConfig",
    "TreeConfig",
    "VLLMConfig",
    "WarmStartConfig",
    "apply_override",
    "installed_vllm_build",
    "load_config",
    "node_memory_bytes",
    "preset_names",
    "resume_config",
    "save_run_config",
]
