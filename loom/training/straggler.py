"""``--log-straggler``: Megatron-LM's straggler detector (``megatron/core/utils.py``
``StragglerDetector``; its README ``megatron/core/README_STRAGGLER.md``), loom's own
implementation.

Every rank times its forward passes (each micro-batch's ``forward_step``) and its batch fetch.
At each ``--log-interval`` all ranks exchange their per-iteration means (one ``all_gather`` of
3 floats per rank) and rank 0 prints one line naming the fastest and slowest rank of each:

    straggler | MnRtt/Rnk: 41.2ms/3 | MxRtt/Rnk: 57.9ms/6 | MnDRtt/Rnk: 0.4ms/0 |
    MxDRtt/Rnk: 1.1ms/5 | MnEtpt/Rnk: 137.4TF/6 | MxEtpt/Rnk: 193.0TF/3

``Rtt``: forward milliseconds per iteration; ``DRtt``: batch-fetch milliseconds per iteration;
``Etpt``: the estimated throughput in TFLOP/s, Megatron's definition: the model FLOPs of an
iteration per rank, divided by 3 (the forward's share of forward + backward, Megatron's
``amp``), over the forward time. With ``--straggler-minmax-count N`` (1 < N < world size) two
more lines list the N ranks of lowest and of highest estimated throughput. Megatron's GPU
power, temperature, utilization and clock columns are left out (they need NVML).

``--disable-straggler-on-startup`` starts with the detector off; on rank 0 an HTTP request to
``--straggler-ctrlr-port`` (``curl localhost:PORT``) toggles it at the next report (all ranks
agree through one broadcast), as Megatron's controller does. A port that cannot be bound is
named once and the detector runs without a controller.
"""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import torch
import torch.distributed as dist

FORWARD_SHARE = 3.0
"""Megatron's ``amp``: forward + backward FLOPs over the forward's (the detector times the
forward only)."""


class StragglerDetector:
    """One rank's straggler detector (see the module docstring). ``flops_per_iter``: the model
    FLOPs of one iteration over all ranks (set by the builder); ``count``:
    ``--straggler-minmax-count``; ``enabled``: not ``--disable-straggler-on-startup``;
    ``port``: ``--straggler-ctrlr-port`` (rank 0 serves it)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, count: int = 1,
                 enabled: bool = True, port: Optional[int] = None):
        self.rank, self.world, self.device = rank, world_size, device
        self.count, self.on = count, enabled
        self.flops_per_iter = 0.0
        self.forward_s = self.batch_s = 0.0
        self.toggle_requested = threading.Event()
        self.server: Optional[ThreadingHTTPServer] = None
        self.notes: list[str] = []
        if rank == 0 and port is not None:
            self._serve(port)

    # -- timing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def timing(self, what: str):
        """Time the block as ``"forward"`` or ``"batch"`` (seconds, wall clock after a CUDA
        synchronize at both ends) while the detector is on."""
        if not self.on:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            if what == "forward":
                self.forward_s += elapsed
            else:
                self.batch_s += elapsed

    def wrap(self, forward_step: Callable) -> Callable:
        """``forward_step`` timed as the forward (the output's loss function is not)."""
        def timed(*args, **kwargs):
            with self.timing("forward"):
                return forward_step(*args, **kwargs)
        return timed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- report -------------------------------------------------------------------------------
    def report(self, iterations: int, say: Callable[[str], None]) -> Optional[dict]:
        """At a ``--log-interval`` of ``iterations`` iterations, on every rank (a collective):
        exchange the means and, on rank 0, ``say`` the line(s); then apply a toggle requested
        on the controller. Returns rank 0's ``{"forward_ms": [..], "batch_ms": [..],
        "tflops": [..]}`` (one value per rank), None elsewhere or while off."""
        out = None
        if self.on and iterations > 0:
            mine = self._means(iterations)
            table = self._gather(mine)
            self.forward_s = self.batch_s = 0.0
            if self.rank == 0:
                out = {"forward_ms": [r[0] for r in table], "batch_ms": [r[1] for r in table],
                       "tflops": [r[2] for r in table]}
                for line in self.lines(out):
                    say(line)
        self._apply_toggle(say)
        return out

    def _means(self, iterations: int) -> list[float]:
        fwd = self.forward_s / iterations
        tflops = self.flops_per_iter / self.world / FORWARD_SHARE / fwd / 1e12 if fwd > 0 else 0.0
        return [1e3 * fwd, 1e3 * self.batch_s / iterations, tflops]

    def _gather(self, mine: list[float]) -> list[list[float]]:
        if not (dist.is_initialized() and self.world > 1):
            return [mine]
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return [p.tolist() for p in parts]

    def lines(self, table: dict) -> list[str]:
        """The report of ``table`` (:meth:`report`'s dict): Megatron's min/max columns and,
        with ``--straggler-minmax-count`` N (1 < N < world), the N lowest and highest ranks by
        estimated throughput."""
        def lo_hi(values: list[float], unit: str, fmt: str) -> tuple[str, str]:
            lo = min(range(len(values)), key=values.__getitem__)
            hi = max(range(len(values)), key=values.__getitem__)
            return (f"{values[lo]:{fmt}}{unit}/{lo}", f"{values[hi]:{fmt}}{unit}/{hi}")
        rtt, drtt, etpt = (lo_hi(table[k], u, f) for k, u, f in (
            ("forward_ms", "ms", ".1f"), ("batch_ms", "ms", ".1f"), ("tflops", "TF", ".2f")))
        out = [f"straggler | MnRtt/Rnk: {rtt[0]} | MxRtt/Rnk: {rtt[1]} | MnDRtt/Rnk: {drtt[0]} | "
               f"MxDRtt/Rnk: {drtt[1]} | MnEtpt/Rnk: {etpt[0]} | MxEtpt/Rnk: {etpt[1]}"]
        n = len(table["tflops"])
        if 1 < self.count < n:
            order = sorted(range(n), key=table["tflops"].__getitem__)
            fmt = lambda ranks: ", ".join(f"{table['tflops'][r]:.2f}TF/{r}" for r in ranks)  # noqa
            out.append(f"^^^^ Bottom {self.count} ranks by Etpt: {fmt(order[:self.count])}")
            out.append(f"^^^^ Top {self.count} ranks by Etpt: {fmt(order[-self.count:][::-1])}")
        return out

    # -- the controller -----------------------------------------------------------------------
    def _serve(self, port: int) -> None:
        detector = self

        class Toggle(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                detector.toggle_requested.set()
                body = (f"straggler detector: {'OFF' if detector.on else 'ON'} at the next "
                        f"report\n").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no per-request stderr line
                pass

        try:
            self.server = ThreadingHTTPServer(("", port), Toggle)
        except OSError as e:
            self.notes.append(f"--straggler-ctrlr-port {port}: cannot listen ({e.strerror}); "
                              f"the straggler detector runs without its controller")
            return
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name="straggler-controller").start()

    def _apply_toggle(self, say: Callable[[str], None]) -> None:
        flip = self.rank == 0 and self.toggle_requested.is_set()
        if flip:
            self.toggle_requested.clear()
        state = [float(self.on != flip)]
        if dist.is_initialized() and self.world > 1:
            device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor(state, device=device)
            dist.broadcast(t, 0)
            state = t.tolist()
        on = state[0] > 0
        if on != self.on:
            self.on = on
            self.forward_s = self.batch_s = 0.0
            if self.rank == 0:
                say(f"straggler detector toggled {'ON' if on else 'OFF'}")

    def close(self) -> None:
        """Stop the controller (end of training)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
