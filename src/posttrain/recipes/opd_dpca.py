"""Cross-tokenizer DPCA on arithmetic: a student with its own BPE vocabulary, the SmolLM2 teacher.

The student is SmolLM2-135M-Instruct cut to 6 layers with a different tokenizer (a ~2k byte-level
BPE trained on arithmetic text, embeddings transferred; ``python -m posttrain.models.opd_demo``).
The teacher renders each prompt with its own chat template, tokenizes the student's completion text
with its own tokenizer and scores it; the two tokenizations are aligned into chunks of identical
text, and each chunk's teacher-minus-student logprob becomes per-token credit
``A(t) = (L_T / L_S - 1) * log p(t)``, trained with the clipped surrogate (``rl.reward=constant``:
the teacher is the only signal). ``train/opd_dpca_chunk_gap_mean`` (student minus teacher chunk
logprob) falls as the student moves toward the teacher. DPCA needs unwarped sampling at temperature
1, ``teacher.top_k=0`` and ``jsd_beta=null``; the preflight refuses anything else.
"""

from posttrain.config.opd import OPDConfig
from posttrain.models.opd_demo import OTHER_VOCAB, demo_dir
from posttrain.recipes.opd_direct import make_config as make_direct


def make_config() -> OPDConfig:
    cfg = make_direct()  # same task, batch, teacher and schedule; another student and objective
    cfg.job.name = "arithmetic_smollm2_dpca"
    cfg.model.name_or_path = str(demo_dir() / OTHER_VOCAB)
    cfg.rl.teacher.input_mode = "cross_token_text"
    cfg.rl.teacher.signal_mode = "dpca"
    cfg.rl.teacher.top_k = 0
    cfg.rl.distillation_mode = "advantage"
    cfg.rl.jsd_beta = None
    cfg.rl.kl_penalty_coef = 1.0
    cfg.rl.reward = "constant"
    cfg.rl.optimizer.lr = 2e-5
    return cfg
