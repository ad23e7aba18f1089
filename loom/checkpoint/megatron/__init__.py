"""Megatron-LM / Megatron-Core checkpoints, both ways.

Reading (``loom train --load DIR``, ``loom checkpoint convert --from-megatron DIR``,
``loom checkpoint inspect DIR``): a Megatron-LM ``--save`` directory (pointer + ``iter_N/`` or
``release/``), one iteration directory, or a bare ``dist_checkpointing`` directory, in the
``torch_dist`` format at any TP / PP / EP, or the legacy ``torch`` format
(``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``), for the GPT family (GPT-2, LLaMA / GQA,
QK-layernorm, MoE, MLA, MTP) and the Mamba / hybrid family.

- :mod:`.locate` (torch-free): which directory is one, which iteration; one-line diagnoses;
- :mod:`.args`: its pickles read without Megatron installed; its saved args as loom's flags;
- :mod:`.names`: loom names <-> Megatron keys (stacked layers and experts, Transformer Engine's
  norm names); :mod:`.layout`: the tensors laid out differently (interleaved QKV, conv1d);
- :mod:`.stores`: the two formats behind one interface; :mod:`.index`: the loom-side reader;
- :mod:`.common`: ``common.pt`` as loom reads it, and the resume into a training run;
- :mod:`.writer`: a loom checkpoint written as Megatron's ``torch_dist``
  (``loom checkpoint convert --to-megatron``);
- :mod:`.inspect`: ``loom checkpoint inspect`` of a Megatron checkpoint.
"""
