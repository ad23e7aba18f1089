"""BERT's :class:`~loom.models.family.ModelFamily` value, ``FAMILY`` (its registry row in
:mod:`loom.models` imports this module; its config hooks come from :mod:`.config`)."""

from loom.data.bert_dataset import build_bert_datasets
from loom.models.bert import config, parallelize
from loom.models.bert.hf import HF
from loom.models.bert.model import BertModel, forward_step  # noqa: F401
from loom.models.family import ModelFamily


def logged_metrics(model) -> tuple[str, ...]:
    """The masked-LM loss, and the sentence-order loss with ``--bert-binary-head``."""
    return ("mlm loss", "sop loss") if model.bert_binary_head else ("mlm loss",)


FAMILY = ModelFamily(name="bert", build=BertModel, plan=parallelize.plan, init=parallelize.init,
                     forward_step=forward_step, datasets=build_bert_datasets,
                     logged_metrics=logged_metrics, evaluation_tasks=("mlm",), hf=HF,
                     wordpiece_data=True, check=config.check,
                     refuse_own_flags=config.refuse_own_flags,
                     layer_kinds=config.layer_kinds)  # no generation: a masked-LM encoder
