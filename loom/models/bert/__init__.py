"""BERT: plain model (:mod:`.model`), plan and initializers (:mod:`.parallelize`), forward
step (masked-LM and sentence-order losses)."""

from loom.models.bert import parallelize
from loom.models.bert.model import BertModel, forward_step  # noqa: F401
from loom.models.family import ModelFamily

FAMILY = ModelFamily(name="bert", build=BertModel, plan=parallelize.plan, init=parallelize.init,
                     forward_step=forward_step)
