"""Which samples each data-parallel rank reads (Megatron's ``MegatronPretrainingSampler`` order)."""

from __future__ import annotations

from typing import Sequence

import torch


def microbatch_indices(consumed_samples: int, micro_batch_size: int, num_microbatches: int,
                       dp_rank: int, dp_size: int) -> list[list[int]]:
    """Sample indices of one iteration for one DP rank: ``num_microbatches`` lists of ``micro_batch_size``.

    The global batch is samples ``[c, c + b*m*d)`` with ``c = consumed_samples``; micro-batch ``j`` covers
    ``[c + j*b*d, c + (j+1)*b*d)`` and rank ``r`` takes its slice ``[r*b, (r+1)*b)``.
    Raises ValueError for negative/zero sizes or ``dp_rank`` outside ``[0, dp_size)``.
    """
    b, m, d, r, c = micro_batch_size, num_microbatches, dp_size, dp_rank, consumed_samples
    if b < 1 or m < 1 or d < 1 or c < 0 or not 0 <= r < d:
        raise ValueError(f"bad sampler arguments: consumed_samples={c} micro_batch_size={b} "
                         f"num_microbatches={m} dp_rank={r} dp_size={d}")
    return [list(range(c + j * b * d + r * b, c + j * b * d + (r + 1) * b)) for j in range(m)]


def get_batch(dataset, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Stack samples: ``{"tokens": LongTensor[b, s], "labels": LongTensor[b, s], ...}`` for
    ``b = len(indices)`` (every field of the samples, e.g. BERT's ``loss_mask``)."""
    samples = [dataset[i] for i in indices]
    return {key: torch.stack([smp[key] for smp in samples]) for key in samples[0]}


class FieldsAdded:
    """A dataset whose samples gain fields: ``sample(k) = dataset[k]`` plus what :meth:`add`
    returns for it; its length and every other attribute are the dataset's. Subclasses
    (:class:`loom.data.loss_mask.EodLossMask`, :class:`loom.data.document_masks.DocumentResets`)
    set ``self.dataset`` and define :meth:`add`."""

    dataset = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["dataset"], name)

    def add(self, sample: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """The fields to add to ``sample`` (the dataset's sample ``k``): ``{name: tensor [s]}``."""
        raise NotImplementedError

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        sample = dict(self.dataset[k])
        sample.update(self.add(sample, k))
        return sample
