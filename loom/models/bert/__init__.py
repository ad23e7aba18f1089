"""BERT: plain model (:mod:`.model`), plan and initializers (:mod:`.parallelize`), forward
step (masked-LM and sentence-order losses), samples (:mod:`loom.data.bert_dataset`), Hugging
Face import (:mod:`.hf`)."""

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
                     refuse_own_flags=config.refuse_own_flags)  # no generation: a masked-LM encoder
