"""Draft-head training: self-distillation data recorded along text (``head_data``), then an EAGLE-3 head
trained on it, resumable (``train_head``)."""
