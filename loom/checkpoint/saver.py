"""The trainer's checkpoint saves: synchronous, or ``--async-save`` (training continues while
DCP writes; the rename and the ``latest`` pointer follow once every rank's files are written).
``--ckpt-format torch_dist`` writes Megatron's format instead of loom's own ``loom_dcp``
(:mod:`loom.checkpoint.megatron.train_save`, synchronous).

An asynchronous save is finalized (rank 0 renames ``iter_N.tmp`` and moves the pointer) at the
first step check that finds its write complete (:meth:`Saver.poll`), at the latest before the
next save starts, and at exit (:meth:`Saver.finish`, which waits). Only one save is in flight.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Callable, Optional

import torch.distributed as dist

from loom.checkpoint.io import PendingSave, finalize_save, start_save
from loom.checkpoint.safety import prune_checkpoints
from loom.data.blended import blend_prefixes
from loom.paths import non_persistent_dir


class Saver:
    """Saves of one training run under ``cfg`` (a LoomConfig); ``async_save``:
    ``--async-save``."""

    def __init__(self, cfg, async_save: bool = False):
        self.cfg, self.async_save = cfg, async_save
        self.pending: Optional[PendingSave] = None
        self.group = None  # DCP's own gloo group for background writes, made at the first save
        self.blocked_s = 0.0  # time the step loop spent in the latest save call
        self.say: Optional[Callable[[str], None]] = None  # the log's print, once given
        self.first_nonfinite: Optional[int] = None  # the run's first skipped iteration
        self.data: Optional[dict] = None  # the datasets' identities (data_match), at open
        self.data_files: dict = {}  # their files' (inode, size, mtime) when opened
        self.data_changed: set = set()  # datasets already said to have changed on disk

    @property
    def verb(self) -> str:
        """How a save call's message starts: the write may still be running."""
        return "saving" if self.async_save else "saved"

    def _tokenizer(self, tokenizer_file: Optional[str]) -> Optional[str]:
        first = blend_prefixes(self.cfg.data.data_path or self.cfg.data.train_data_path)
        return tokenizer_file or (first[0] + ".tokenizer.json" if first else None)

    def opened(self) -> None:
        """Record the identities of the datasets (``meta.json``'s checksums) and their files'
        inode, size and modification time: call right after the datasets were opened, so a
        checkpoint records the data the run trains on, not what lies on disk at its first
        save."""
        from loom.checkpoint.data_match import data_files, data_identities
        self.data, self.data_files = data_identities(self.cfg.data), data_files(self.cfg.data)

    def _data(self) -> dict:
        """The datasets' identities when they were opened, recorded in every checkpoint; at each
        save the files are compared again and a dataset replaced on disk since (``loom
        preprocess --overwrite`` while the job runs) is said once: the run goes on with the
        files it opened, and a resume on the new ones will be refused."""
        from loom.checkpoint.data_match import changed_data
        if self.data is None:
            self.opened()
        for flag, prefix in changed_data(self.data_files):
            if (flag, prefix) not in self.data_changed and self.say is not None:
                self.say(f" {flag} {prefix}: its files changed on disk since this run opened "
                         f"them (`loom preprocess --overwrite`?): this run trains on the files "
                         f"it opened and its checkpoints record those, so a resume on the new "
                         f"files will be refused (--override-data-change accepts them)")
            self.data_changed.add((flag, prefix))
        return self.data

    def save(self, save_dir: str, *, iteration: int, consumed_samples: int, model_chunks,
             optimizer, scheduler, mesh, tracker, tokenizer_file: Optional[str] = None,
             after_write: Optional[Callable[[], None]] = None) -> str:
        """Checkpoint ``model_chunks``, ``optimizer``, ``scheduler`` and the RNG ``tracker`` of
        this rank of ``mesh`` at ``iteration`` (``consumed_samples`` trained on); returns the
        final directory (under ``--async-save`` it appears once the write finished).
        ``after_write``: called once this rank's files are written. Collective over all
        ranks. ``--no-save-optim``: neither the optimizer nor the scheduler is written;
        ``--no-save-rng``: nor the generators (the stored config says so, so a resume without
        ``--no-load-optim`` / ``--no-load-rng`` is refused before it starts:
        :func:`loom.training.resume.check_saved_states`)."""
        t0 = time.perf_counter()
        ck = self.cfg.checkpoint
        if ck.no_save_optim:  # Megatron's generate_state_dict: no optimizer, no scheduler
            optimizer = scheduler = None
        if ck.no_save_rng:
            tracker = None
        self.finish()  # one save in flight: the previous one completes first
        if self.async_save and dist.is_initialized() and self.group is None:
            minutes = self.cfg.fault_tolerance.distributed_timeout_minutes
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(minutes=minutes))
        if self.cfg.training.ckpt_format == "torch_dist":  # Megatron's format (synchronous)
            from loom.checkpoint.megatron.train_save import start_megatron_save
            job = start_megatron_save(save_dir, iteration, model_chunks, optimizer, scheduler,
                                      mesh, consumed_samples=consumed_samples,
                                      config=self.cfg.to_flat(), model_cfg=self.cfg.model,
                                      tokenizer_file=self._tokenizer(tokenizer_file),
                                      after_write=after_write, data=self._data())
        else:
            job = start_save(save_dir, iteration, model_chunks, optimizer, scheduler, mesh,
                             tracker, consumed_samples=consumed_samples,
                             config=self.cfg.to_flat(),
                             tokenizer_file=self._tokenizer(tokenizer_file),
                             async_save=self.async_save, group=self.group,
                             after_write=after_write, data=self._data())
        if job.future is None:
            finalize_save(job)
            self._prune(job)
        else:
            self.pending = job
        self.blocked_s = job.blocked_s = time.perf_counter() - t0
        return job.final

    def _prune(self, job: PendingSave) -> None:
        ck = self.cfg.checkpoint
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        np_dir = non_persistent_dir(ck, ck.save)
        if np_dir and os.path.realpath(job.save_dir) == os.path.realpath(np_dir):
            prune_checkpoints(job.save_dir, 1)  # non-persistent: only the newest
        elif ck.keep_last or ck.save_retain_interval:
            prune_checkpoints(job.save_dir, ck.keep_last, keep_before=self.first_nonfinite,
                              retain_interval=ck.save_retain_interval)

    @staticmethod
    def holds(loaded: Optional[str], save_dir: str, iteration: int) -> bool:
        """Whether ``loaded`` (the checkpoint a run resumed from, no step taken since) is
        ``save_dir``'s checkpoint of ``iteration``: a finished run restarted, whose save would
        only rewrite it."""
        from loom.checkpoint.safety import iteration_dir
        return loaded is not None and \
            os.path.realpath(loaded) == os.path.realpath(iteration_dir(save_dir, iteration))

    def last_good(self, save_dir: Optional[str], iteration: int) -> Optional[int]:
        """The iteration of the newest checkpoint below ``iteration`` in ``save_dir``: a
        complete one on disk, or the save in flight."""
        from loom.checkpoint.safety import last_checkpoint_before
        found = last_checkpoint_before(save_dir, iteration) if save_dir else None
        pending = self.pending.iteration if self.pending is not None else None
        if pending is not None and pending < iteration and (found is None or pending > found):
            return pending
        return found

    def diverged_at(self, iteration: int, save_dir: Optional[str],
                    loaded: Optional[str] = None) -> str:
        """Record ``iteration`` as the run's first non-finite one (once; ``--keep-last`` then
        never prunes the last checkpoint before it); returns the words naming that checkpoint
        (``loaded``: the checkpoint this run started from, named when ``save_dir`` has none)."""
        if self.first_nonfinite is None:
            self.first_nonfinite = iteration
        good = self.last_good(save_dir, self.first_nonfinite)
        if good is None:
            return (f"the last checkpoint before the first non-finite iteration "
                    f"({self.first_nonfinite}) is the one this run loaded, {loaded}"
                    if loaded else
                    f"no checkpoint was saved before iteration {self.first_nonfinite}")
        keep = " (kept by --keep-last)" if self.cfg.checkpoint.keep_last else ""
        return (f"the last checkpoint before the first non-finite iteration "
                f"({self.first_nonfinite}) is iteration {good}, "
                f"{os.path.join(save_dir, f'iter_{good:07d}')}{keep}")

    def _done(self, say: Optional[Callable[[str], None]]) -> None:
        self.say = say = say or self.say
        job, self.pending = self.pending, None
        final = finalize_save(job, barrier=False)
        self._prune(job)
        if say is not None:
            say(f" saved checkpoint {final} (--async-save: written in {job.written_s:.3g} s, "
                f"the step loop blocked {job.blocked_s:.3g} s)")

    def poll(self, say: Optional[Callable[[str], None]] = None) -> None:
        """Finalize an asynchronous save whose write completed; never waits. ``say``: where
        finalized saves are reported (remembered for the saves finalized by the next save)."""
        self.say = say or self.say
        if self.pending is not None and self.pending.future.done():
            self._done(say)

    def finish(self, say: Optional[Callable[[str], None]] = None) -> None:
        """Wait for an asynchronous save in flight and finalize it (next save, exit). Raises
        CheckpointWriteError when its write failed."""
        if self.pending is not None:
            self._done(say)

    def close(self, say: Optional[Callable[[str], None]] = None) -> None:
        """At exit, also after an error: wait for a save in flight; a failed one is reported
        on stderr (its partial ``.tmp`` is removed at the next start)."""
        try:
            self.finish(say)
        except Exception as e:  # noqa: BLE001 - exiting already; say why the save is lost
            print(f"loom: {e}", file=sys.stderr, flush=True)
