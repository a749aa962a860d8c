"""train: fits what passes inserted, and trains the project's reference model.

- ``layerskip``: the LayerSkip recipe (layer dropout + early-exit loss with curricula) and the
  pure formulas it is made of;
- ``data``: the stdlib corpus split by file, text folders, byte-level and BPE tokenizers,
  held-out prompts;
- ``trainer``: a resumable AdamW trainer with safetensors + JSON checkpoints;
- ``evaluate``: held-out loss, bits per byte, per-exit agreement with the last layer;
- ``reference``: trains the project's reference model (``examples/train_reference.py``).
"""

from leapfx.train.data import (
    CorpusSplit,
    Document,
    Prompt,
    byte_tokenizer,
    encode_documents,
    held_out_prompts,
    is_held_out,
    load_text_documents,
    stdlib_corpus,
    stdlib_files,
    token_byte_lengths,
    train_bpe_tokenizer,
)
from leapfx.train.evaluate import ExitReport, evaluate_exits, greedy_loop_stats
from leapfx.train.layerskip import (
    LayerSkipLoss,
    LayerSkipTrainConfig,
    dropout_rate,
    enabled_exit_layers,
    exit_logits,
    exit_loss_scales,
    layerskip_loss,
    run_decoder,
    sample_keep_mask,
)
from leapfx.train.reference import REFERENCE_RECIPE, ReferenceModelSpec, train_reference
from leapfx.train.trainer import (
    LayerSkipTrainer,
    TrainerConfig,
    TrainResult,
    lr_at,
    save_pretrained_atomic,
)

__all__ = [
    "REFERENCE_RECIPE",
    "CorpusSplit",
    "Document",
    "ExitReport",
    "LayerSkipLoss",
    "LayerSkipTrainConfig",
    "LayerSkipTrainer",
    "Prompt",
    "ReferenceModelSpec",
    "TrainResult",
    "TrainerConfig",
    "byte_tokenizer",
    "dropout_rate",
    "enabled_exit_layers",
    "encode_documents",
    "evaluate_exits",
    "exit_logits",
    "exit_loss_scales",
    "greedy_loop_stats",
    "held_out_prompts",
    "is_held_out",
    "layerskip_loss",
    "load_text_documents",
    "lr_at",
    "run_decoder",
    "sample_keep_mask",
    "save_pretrained_atomic",
    "stdlib_corpus",
    "stdlib_files",
    "token_byte_lengths",
    "train_bpe_tokenizer",
    "train_reference",
]
