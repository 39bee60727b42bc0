"""Multi-token-prediction heads: ``families`` (what differs per model family, a module each),
``heads`` (setting the tensors aside at load, building and attaching the head), ``decoding``
(the head as a draft model for mlx-lm's speculative loop)."""
