"""The planner hands over a decision (issue 15, item 7): the ``torchrun ... -m loom train``
command of the chosen layout (or of row N) runs; every column of the table has a legend;
``--config FILE.yaml`` fixes the search with the file's batch and parallel sizes;
``--from-hf config.json`` reads a Hugging Face model config."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import main
from loom.errors import ConfigError
from loom.planner.command import LEGEND, hf_model_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["plan", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "100", "--seq-length", "16", "--num-gpus", "2", "--gpus-per-node", "2",
        "--global-batch-size", "4", "--top", "3"]


def _plan(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return out


def _command(out: str) -> list[str]:
    text = out[out.index("torchrun "):]
    return shlex.split(text.replace("\\\n", " "))


def test_printed_command_runs_under_torchrun(capsys, tmp_path):
    out = _plan(TINY + ["--tensor-model-parallel-size", "2"], capsys)
    cmd = _command(out)
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m"]
    assert "--tensor-model-parallel-size" in cmd and cmd[cmd.index("--tensor-model-parallel-size")
                                                         + 1] == "2"
    cmd[0] = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd + ["--train-iters", "2", "--lr", "3e-4", "--mock-data",
                              "--no-progress-bar"],
                       env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "iteration      2" in r.stdout and "'tp': 2" in r.stdout, r.stdout


def test_command_for_row_and_json(capsys):
    out = _plan(TINY + ["--command-for", "3"], capsys)
    assert "command for row 3" in out
    doc = json.loads(_plan(TINY + ["--json"], capsys))
    rec = doc["layouts"][2]
    flags = _command(rec["command"])
    assert flags[flags.index("--micro-batch-size") + 1] == str(rec["micro_batch_size"])
    assert flags[flags.index("--global-batch-size") + 1] == "4"
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--command-for", "9"])
    assert e.value.code == 2 and "--command-for 9" in capsys.readouterr().err


def test_legend_names_every_column(capsys):
    out = _plan(TINY, capsys)
    header = next(ln for ln in out.splitlines() if ln.startswith("#  tp"))
    words = header.replace("|", " ").replace("#", " ").split()
    for w in words:
        assert f" {w} " in LEGEND.replace("\n", " ") or LEGEND.startswith(w), w
    assert "--num-layers-per-virtual-pipeline-stage = L / (p x vp) LAYERS" in LEGEND
    assert LEGEND in out


def test_plan_config_file_fixes_batch_and_parallel_sizes(tmp_path, capsys):
    y = tmp_path / "run.yaml"
    y.write_text("model:\n  num_layers: 4\n  hidden_size: 64\n  num_attention_heads: 4\n"
                 "  vocab_size: 100\n  seq_length: 32\nparallel:\n"
                 "  pipeline_model_parallel_size: 2\ntraining:\n  micro_batch_size: 1\n"
                 "  global_batch_size: 8\n")
    doc = json.loads(_plan(["plan", "--config", str(y), "--num-gpus", "4", "--json"], capsys))
    assert doc["global_batch_size"] == 8 and doc["layouts"]
    assert all(r["pp"] == 2 and r["micro_batch_size"] == 1 for r in doc["layouts"])
    # a flag still overrides the file
    doc = json.loads(_plan(["plan", "--config", str(y), "--num-gpus", "4", "--json",
                            "--global-batch-size", "16"], capsys))
    assert doc["global_batch_size"] == 16


def test_without_a_global_batch_the_plan_takes_what_loom_train_would(tmp_path, capsys):
    """No --global-batch-size: with the micro-batch and the TP / PP / CP sizes all given, B is
    b x d, Megatron's default that loom train runs (a torchtitan config gives them: its
    global batch is its local batch times its data-parallel size); otherwise 1,024 rounded up
    to a multiple of the GPUs."""
    base = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--vocab-size", "100", "--seq-length", "32", "--num-gpus", "8", "--json"]
    sizes = ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1"]
    assert json.loads(_plan(base + sizes, capsys))["global_batch_size"] == 2 * 4
    assert json.loads(_plan(base + sizes[:4], capsys))["global_batch_size"] == 1024
    toml = tmp_path / "tt.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\n'
                    'local_batch_size = 2\nseq_len = 64\n[parallelism]\n'
                    'tensor_parallel_degree = 2\n')
    doc = json.loads(_plan(["plan", "--config", str(toml), "--num-gpus", "8", "--json"],
                           capsys))
    assert doc["global_batch_size"] == 2 * 4  # torchtitan's: local x DP 4


HF = {
    "llama": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "vocab_size": 50257, "layer_norm_epsilon": 1e-5,
             "activation_function": "gelu_new"},
    "mixtral": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
}


def test_from_hf_config(tmp_path, capsys):
    paths = {}
    for name, hf in HF.items():
        paths[name] = tmp_path / name / "config.json"
        paths[name].parent.mkdir()
        paths[name].write_text(json.dumps(hf))
    m = hf_model_config(str(paths["llama"]))
    assert (m.num_layers, m.hidden_size, m.num_kv_groups, m.ffn_size, m.vocab_size) == \
        (32, 4096, 8, 14336, 128256)
    assert m.normalization == "RMSNorm" and m.swiglu and m.rotary_base == 500000.0
    assert m.seq_length == 4096 and m.max_positions == 131072
    g = hf_model_config(str(paths["gpt2"]))
    assert (g.num_layers, g.hidden_size, g.normalization, g.openai_gelu) == (12, 768,
                                                                             "LayerNorm", True)
    x = hf_model_config(str(paths["mixtral"]))
    assert (x.num_experts, x.moe_router_topk, x.moe_ffn_size) == (8, 2, 14336)
    doc = json.loads(_plan(["plan", "--from-hf", str(paths["llama"]), "--gpu", "H100-80GB",
                            "--num-gpus", "64", "--global-batch-size", "512", "--seq-length",
                            "8192", "--json", "--top", "1"], capsys))
    assert doc["model"] == "llama" and doc["seq_length"] == 8192
    assert 7.5e9 < doc["params"] < 8.5e9  # Llama 3 8B
    bad = tmp_path / "bert.json"
    bad.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SystemExit) as e:
        main(["plan", "--from-hf", str(bad)])
    assert e.value.code == 2 and "--from-hf" in capsys.readouterr().err


def test_from_hf_reads_rope_scaling_as_loom_train_does(tmp_path):
    """Llama 3.1's ``rope_scaling`` (llama3, factor 8) reaches the planned model, hence its
    printed command, as loom's HF import reads it; a scaling loom does not train is refused."""
    path = tmp_path / "config.json"
    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    path.write_text(json.dumps({**HF["llama"], "rope_scaling": scaling}))
    m = hf_model_config(str(path))
    assert m.use_rope_scaling and m.rope_scaling_factor == 16.0
    path.write_text(json.dumps({**HF["llama"], "rope_scaling": {"rope_type": "dynamic",
                                                                 "factor": 2.0}}))
    with pytest.raises(ConfigError, match="--from-hf .*dynamic"):
        hf_model_config(str(path))


def test_command_multi_node_virtual_stages_and_zero():
    from loom.config import ModelConfig
    from loom.planner.command import train_command
    model = ModelConfig.llama(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=100,
                              seq_length=32)
    rec = {"tp": 2, "pp": 2, "cp": 1, "ep": 1, "vp": 2, "first_stage_layers": 0,
           "last_stage_layers": 0, "sequence_parallel": True, "recompute": "full", "zero": 2,
           "micro_batch_size": 1}
    text = train_command(rec, model, 64, 32, num_gpus=16, gpus_per_node=8)
    assert not text.startswith("#")  # ZeRO-2 runs as itself (issue 45 item 4)
    words = shlex.split(text.replace("\\\n", " "))
    assert words[words.index("--zero-stage") + 1] == "2"
    assert words[:9] == ["torchrun", "--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend",
                         "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500"]
    at = words.index("--num-layers-per-virtual-pipeline-stage")
    assert words[at + 1] == "2"  # L / (p x vp) = 8 / (2 x 2) layers, not the chunk count
    for w in ("--sequence-parallel", "--swiglu",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert w in words, w
    assert words[words.index("--recompute-granularity") + 1] == "full"
    # Megatron requires both with full recomputation: the planner's model (every layer's input)
    assert words[words.index("--recompute-method") + 1] == "uniform"
    assert words[words.index("--recompute-num-layers") + 1] == "1"
    assert words[words.index("--normalization") + 1] == "RMSNorm"


def test_a_reader_that_leaves_ends_the_plan_quietly():
    """``loom plan ... | head -1``: the table (134 KB, past a pipe's 64 KB buffer) meets a
    closed pipe; loom ends as a Unix tool does, status 141 (SIGPIPE), no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "loom", "plan", "llama3-8b", "--num-gpus", "8",
                          "--top", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.stdout.readline().startswith(b"loom plan: llama3-8b")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and b"Traceback" not in err and b"Error" not in err, err
