"""Same-tokenizer direct OPD on arithmetic: a 6-layer SmolLM2 student, the full SmolLM2 teacher.

The student is SmolLM2-135M-Instruct cut to its first 6 of 30 decoder layers (same tokenizer), made
once by ``python -m posttrain.models.opd_demo``; the teacher is the full embedded model. The student
samples answers to "What is a + b?", the teacher returns its top-8 next-token distribution at every
position the student reached, and the student minimises the reverse KL (``jsd_beta=1``) over the
8 + 1 categories (top-8 plus the residual mass). ``train/opd_divergence`` falls as the truncated
student recovers the teacher's behaviour on its own samples; the arithmetic reward is reported as a
diagnostic only. Runs on a 2-core CPU (docs/opd.md has the figures).
"""

from posttrain.config.opd import OPDConfig
from posttrain.models.opd_demo import SAME_VOCAB, demo_dir


def make_config() -> OPDConfig:
    cfg = OPDConfig()
    cfg.job.group = "opd"
    cfg.job.name = "arithmetic_smollm2_direct"
    cfg.model.name_or_path = str(demo_dir() / SAME_VOCAB)
    cfg.rl.teacher.name_or_path = "embedded:smollm2-135m-instruct"
    cfg.rl.teacher.input_mode = "shared_vocab"
    cfg.rl.teacher.signal_mode = "topk"
    cfg.rl.teacher.top_k = 8
    cfg.rl.distillation_mode = "direct"
    cfg.rl.jsd_beta = 1.0
    cfg.rl.reward = "arithmetic"
    cfg.rl.max_steps = 30
    cfg.rl.group_size = 4
    cfg.rl.batch_per_replica = 16
    cfg.rl.optimizer.lr = 5e-5
    cfg.rollout.max_tokens = 24
    return cfg
