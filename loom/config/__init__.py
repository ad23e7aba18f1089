"""Configuration: dataclasses whose field names are Megatron-LM's flag names, filed by concern.

Every field ``foo_bar`` of the sections is the command-line flag ``--foo-bar`` and the YAML key
``foo_bar`` (or ``foo-bar``) of ``--config FILE.yaml`` (flat, or grouped under the section
names ``model``, ``parallel``, ``training``, ``data``, ``logging``, ``checkpoint``,
``fault_tolerance``); flags given on
the command line override the file. :meth:`LoomConfig.validate` refuses bad values and impossible
layouts with a :class:`ConfigError` that names the flag and the fix, before any process group is
created.

Modules: :mod:`~loom.config.sections` (the fields, their help and bounds),
:mod:`~loom.config.core` (:class:`LoomConfig`), :mod:`~loom.config.validate` (the one validation
pass, applying the rules of :mod:`~loom.config.pipeline` and :mod:`~loom.config.split`),
:mod:`~loom.config.args` (argparse and YAML). The package imports nothing of loom but
:mod:`loom.errors` (tests/unit/test_layers.py).
"""

from loom.config.args import add_config_arguments, config_from_args, read_yaml_config
from loom.config.core import LoomConfig, field_section, flag
from loom.config.sections import (GROUPS, CheckpointConfig, DataConfig,
                                  FaultToleranceConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, TrainingConfig)
from loom.errors import ConfigError

__all__ = ["GROUPS", "CheckpointConfig", "ConfigError", "DataConfig", "FaultToleranceConfig",
           "LoggingConfig",
           "LoomConfig", "ModelConfig", "ParallelConfig", "TrainingConfig",
           "add_config_arguments", "config_from_args", "field_section", "flag",
           "read_yaml_config"]
