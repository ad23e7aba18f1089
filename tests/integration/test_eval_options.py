"""Megatron's validation and loop flags in tiny in-process ``loom train`` runs (Megatron-LM
d98e8a6, megatron/training/training.py): ``--start-eval-at-iter`` (when evaluations happen),
``--full-validation`` (every validation sample once, the mean over them),
``--multiple-validation-sets`` / ``--validation-set-names`` (one logged loss per named set),
``--iterations-to-skip`` (data consumed, no step), ``--phase-transition-iterations`` (save and
exit at each, the next phase reads its own data from its first sample) and
``--no-pad-vocab-size`` (V rows). Each run's training losses equal the run without the flag
(same seed). Refusals: tests/unit/test_eval_flags.py."""

from __future__ import annotations

import json

import pytest
import torch

from loom.parallel.mesh import ParallelMesh
from testkit import run_distributed
from testkit.config import tiny_config
from testkit.data import Recording, write_dataset

B = 4  # global batch (micro-batches of 2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A training set and two validation sets of other token ranges (their losses differ)."""
    root = tmp_path_factory.mktemp("evalopts")
    return {"train": write_dataset(root / "train", 1, 99, 40, 0),
            "wiki": write_dataset(root / "wiki", 1, 40, 8, 1),
            "code": write_dataset(root / "code", 50, 99, 6, 4)}


def _trainer(data=None, valid: str = "wiki", **flat):
    from loom.training.trainer import Trainer
    run = dict(global_batch_size=B, train_iters=2, log_interval=1, eval_iters=1,
               no_progress_bar=True)
    if data is not None:
        run.update(mock_data=False, data_path=data["train"], split="100,0,0",
                   valid_data_path=" ".join(data[v] for v in valid.split()))
    cfg = tiny_config("gpt", run, **flat).validate(1)
    return Trainer(cfg, mesh=ParallelMesh.single())


def _valid(tr) -> list[tuple]:
    return [(e["iteration"], e.get("valid_set"), e["valid_loss"]) for e in tr.evaluations
            if e["kind"] == "valid"]


def test_start_eval_at_iter_delays_the_periodic_evaluations():
    """Megatron evaluates at multiples of --eval-interval from --start-eval-at-iter on, and
    after the loop; the evaluations that happen and the training are those of the run
    without the flag."""
    runs = {}
    for start in (None, 3, 6, 9):
        tr = _trainer(train_iters=6, eval_interval=2, start_eval_at_iter=start)
        runs[start] = ([r["loss"] for r in tr.train()], _valid(tr))
    assert [v[0] for v in runs[None][1]] == [2, 4, 6]
    assert [v[0] for v in runs[3][1]] == [4, 6]
    assert [v[0] for v in runs[6][1]] == [6] == [v[0] for v in runs[9][1]]  # the final one
    for start in (3, 6, 9):
        assert runs[start][0] == runs[None][0]  # the same ops: the same losses
        assert runs[start][1] == runs[None][1][-len(runs[start][1]):]


def test_full_validation_reads_every_sample_once(data):
    """N validation samples (N not a multiple of B_eval = 4): every evaluation reads each
    once, and its loss is their mean: the loss of evaluating them one by one (--eval-iters N
    of batch 1), not the first --eval-iters batches'; training is unchanged."""
    tr = _trainer(data, full_validation=True, eval_interval=1, eval_global_batch_size=4,
                  eval_micro_batch_size=2)
    (name, ds), = tr.evaluator.valid_sets
    n = len(ds)
    assert name is None and n % 4 and n > 4
    seen = Recording(ds)
    tr.evaluator.valid_sets = [(None, seen)]
    losses = [r["loss"] for r in tr.train()]
    assert sorted(seen.read) == sorted(list(range(n)) * 2)  # two evaluations, all N each
    assert [e["valid_samples"] for e in tr.evaluations if e["kind"] == "valid"] == [n, n]
    ref = _trainer(data, eval_interval=1, eval_iters=n, eval_global_batch_size=1,
                   eval_micro_batch_size=1)
    assert [r["loss"] for r in ref.train()] == losses
    first = _trainer(data, eval_interval=1)  # --eval-iters 1: 4 samples
    assert [r["loss"] for r in first.train()] == losses
    for (it, _, full), (it2, _, one_by_one), (_, _, four) in zip(_valid(tr), _valid(ref),
                                                                   _valid(first)):
        assert it == it2 and full == pytest.approx(one_by_one, rel=1e-6)
        assert abs(full - four) > 1e-4


def _full_dp(cfg_flat: dict, data: dict) -> float:
    from loom.training.trainer import Trainer
    run = dict(global_batch_size=B, train_iters=1, eval_iters=1, no_progress_bar=True,
               mock_data=False, data_path=data["train"], split="100,0,0",
               valid_data_path=data["code"])
    cfg = tiny_config("gpt", run, **cfg_flat).validate(2)
    return Trainer(cfg).evaluate(full=True)["valid_loss"]


def test_full_validation_at_dp2_matches_one_rank(data):
    """DP = 2 with an odd N: the last sample's rank-mate reads a filler weighed 0; the mean is
    one rank's."""
    flat = dict(eval_global_batch_size=4, eval_micro_batch_size=1)
    one = _trainer(data, valid="code", **flat)
    n = len(one.parts.data.valid_ds)
    assert n % 2 == 1, n
    want = one.evaluate(full=True)["valid_loss"]
    got = run_distributed(2, _full_dp, flat, data)
    assert got[0] == pytest.approx(want, rel=1e-5) and got[1] == pytest.approx(want, rel=1e-5)


def test_multiple_validation_sets_are_evaluated_and_logged_by_name(data, tmp_path, capsys):
    """--valid-data-path A B: each dataset a set of its own, its loss that of a run
    validating on it alone, logged as validation-NAME (JSON lines, TensorBoard, console)."""
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    tr = _trainer(data, valid="wiki code", multiple_validation_sets=True,
                  validation_set_names="wiki code", eval_interval=1, log_json=str(log),
                  tensorboard_dir=str(tb))
    losses = [r["loss"] for r in tr.train()]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    valid = [(r["iteration"], r["valid_set"], r["valid_loss"]) for r in records
             if r["kind"] == "valid"]
    assert [v[:2] for v in valid] == [(1, "wiki"), (1, "code"), (2, "wiki"), (2, "code")]
    for name in ("wiki", "code"):
        alone = _trainer(data, valid=name, eval_interval=1)
        assert [r["loss"] for r in alone.train()] == losses
        assert [v[2] for v in valid if v[1] == name] == \
            pytest.approx([v[2] for v in _valid(alone)], rel=1e-6)
    assert abs(valid[0][2] - valid[1][2]) > 1e-3
    assert " validation-wiki at iteration      2" in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"valid-wiki/valid_loss", "valid-code/valid_loss"} <= set(tags)
    assert [e.value for e in acc.Scalars("valid-code/valid_loss")] == \
        pytest.approx([v[2] for v in valid if v[1] == "code"], rel=1e-6)
    numbered = _trainer(data, valid="wiki code", multiple_validation_sets=True,
                        full_validation=True)
    numbered.train()
    assert [(e["valid_set"], e["valid_samples"]) for e in numbered.evaluations] == \
        [("0", len(tr.evaluator.valid_sets[0][1])), ("1", len(tr.evaluator.valid_sets[1][1]))]


def _params(tr) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.params]


def test_iterations_to_skip_consume_the_data_and_take_no_step(tmp_path):
    """Iteration 2 skipped: nothing read, no update; iteration 3 reads the batch after it
    (samples [2B, 3B)) with the LR of the second step, as a run that steps twice and jumps
    its data past one batch does; the weights after a skipped last iteration are those of
    the iteration before, and the evaluation after the loop still runs."""
    log = tmp_path / "log.jsonl"
    tr = _trainer(train_iters=4, iterations_to_skip="2", log_json=str(log))
    seen = Recording(tr.parts.data.train_ds)
    tr.parts.data.train_ds = seen
    recs = tr.train()
    assert [r["iteration"] for r in recs] == [1, 3, 4] and tr.consumed_samples == 4 * B
    assert seen.read == list(range(B)) + list(range(2 * B, 4 * B))
    skip = [json.loads(x) for x in log.read_text().splitlines() if '"skip"' in x]
    assert [(r["iteration"], r["consumed_samples"]) for r in skip] == [(2, 2 * B)]
    ref = _trainer(train_iters=4)
    want = [ref.train_step()["loss"]]
    ref.consumed_samples += B  # the skipped batch
    want += [ref.train_step()["loss"], ref.train_step()["loss"]]
    assert [r["loss"] for r in recs] == want
    assert [r["lr"] for r in recs] == [r["lr"] for r in ref.history]
    last = _trainer(train_iters=2, iterations_to_skip="2")
    last.train()
    one = _trainer(train_iters=1)
    one.train()
    assert all(torch.equal(a, b) for a, b in zip(_params(last), _params(one)))
    assert (last.iteration, last.consumed_samples) == (2, 2 * B)
    assert [e["iteration"] for e in last.evaluations] == [2]


def _read(tr) -> tuple[list[dict], list[int]]:
    seen = Recording(tr.parts.data.train_ds)
    tr.parts.data.train_ds = seen
    return tr.train(), seen.read


def test_data_phases_exit_at_each_transition_and_read_each_phase_from_its_start(data, tmp_path):
    """Megatron-LM's --phase-transition-iterations 2,4: the first phase trains on one dataset
    and saves and exits at 2; the second, resumed on other data (accepted there: a new phase),
    reads it from sample 0 and exits at 4; resumed at 3 (mid-phase) it reads from (3 - 2) x B
    and repeats the uninterrupted iteration 4, and other data is refused there."""
    from loom.checkpoint.data_match import check_same_data
    from loom.errors import ConfigError
    ck = str(tmp_path / "ck")
    phases = dict(train_iters=6, phase_transition_iterations="2,4", save=ck, save_interval=1)
    recs, read = _read(_trainer(data, **phases))
    assert [r["iteration"] for r in recs] == [1, 2] and read == list(range(2 * B))
    other = {**data, "train": data["code"]}  # the second phase's data

    def resumed(d, **flat):
        tr = _trainer(d, **phases, load=ck, **flat)
        check_same_data(tr.cfg, tr.loaded_from)
        return tr
    recs, read = _read(resumed(other))
    assert [r["iteration"] for r in recs] == [3, 4] and read == list(range(2 * B))
    with pytest.raises(ConfigError, match="was trained on other data"):  # without phases
        check_same_data(_trainer(other, load=ck, train_iters=6).cfg, ck + "/iter_0000002")
    again, read = _read(resumed(other, ckpt_step=3))  # mid-phase: from (3 - 2) x B
    assert read == list(range(B, 2 * B)) and again[0]["iteration"] == 4
    assert again[0]["loss"] == pytest.approx(recs[1]["loss"], rel=1e-6)
    with pytest.raises(ConfigError, match="was trained on other data"):
        resumed(data, ckpt_step=3)  # mid-phase, the first phase's data
    with pytest.raises(ConfigError, match="needs the global batch of the checkpoint"):
        check_same_data(tiny_config("gpt", dict(global_batch_size=2 * B, train_iters=6,
                                                load=ck, phase_transition_iterations="2,4"))
                        .validate(1), ck + "/iter_0000004")


def test_no_pad_vocab_size_builds_v_rows():
    """V = 100: Megatron's default pads the embedding to 128 rows (in the softmax);
    --no-pad-vocab-size keeps 100, training as --padded-vocab-size 100 does."""
    runs = {}
    for key, flat in (("padded", {}), ("unpadded", dict(no_pad_vocab_size=True)),
                      ("given", dict(padded_vocab_size=100))):
        tr = _trainer(**flat)
        rows = {p.shape[0] for n, p in tr.model_chunks[0].named_parameters()
                if "word_embeddings" in n}
        runs[key] = (rows, [r["loss"] for r in tr.train()])
    assert runs["padded"][0] == {128} and runs["unpadded"][0] == {100}
    assert runs["unpadded"] == runs["given"]
    assert runs["unpadded"][1] != runs["padded"][1]
