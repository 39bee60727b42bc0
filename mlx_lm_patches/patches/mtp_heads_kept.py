"""Checkpoints with multi-token-prediction (MTP) tensors load, with the backbone intact and the
MTP head kept (Qwen3-Next, Qwen3.5/3.6 dense and MoE, Nemotron-H; DeepSeek-V3, DeepSeek-V3.2,
GLM-4.5/4.6/4.7, GLM-4.7-Flash and GLM-5, whose head is the layer after the backbone's last; MiMo's
``mtp_layers``; ERNIE 4.5 MoE's ``mtp_block``; K-EXAONE's ``mtp.*``; MiMo-V2-Flash's
``model.mtp.layers.*`` and Step-3.5-Flash's layers past the backbone's (every MTP layer, one per draft step); Ling 3.0's layer past the backbone's; LongCat-Flash's and
LongCat-Flash-Lite's ``model.mtp``).

Bug
    mlx-lm has no module for the MTP head that Qwen3-Next, Qwen3.5/3.6 and Nemotron-H
    (Nemotron 3 Super) checkpoints carry, and
    its ``sanitize`` methods handle the ``mtp.*`` tensors badly (docs/archive/2026-11-research/mtp.md, measured):
    * qwen3_next, MLX-format weights (every release): ``sanitize`` returns before its ``mtp.``
      filter, so loading fails: ``Received N parameters not in model``.
    * qwen3_5 / qwen3_5_moe 0.30.7 - 0.31.3: the presence of ``mtp.*`` keys makes ``sanitize``
      treat MLX-format weights as HF ones and add 1.0 to every backbone norm weight - a
      silently corrupted model. (For HF-layout weights that same signal is right: they keep it.)
    * nemotron_h <= 0.31.1: no filter at all, the load fails like qwen3_next.
    * deepseek_v3 (every release): ``sanitize`` drops ``model.layers.61`` - DeepSeek-V3's own
      depth - so a checkpoint of the architecture with another depth that ships its MTP layer
      fails the same way (deepseek_v32 too up to 0.30.6; later releases drop every layer past
      the backbone's, and glm_moe_dsa - GLM-5, deepseek_v32's model - with it); glm4_moe and
      glm4_moe_lite drop the layer, mimo its ``mtp_layers``,
      ernie4_5_moe its ``mtp_*`` tensors, exaone_moe its ``mtp.*`` ones,
      mimo_v2_flash, longcat_flash and longcat_flash_ngram their ``model.mtp.*`` ones, step3p5 and bailing_moe_v3
      their layers past the backbone's.
    * everywhere else the head is dropped without a word; an ``mtp.safetensors`` sidecar is
      never read.

Fix
    Wrap each family's ``Model.sanitize`` so the ``mtp.`` tensors are set aside before the stock
    code sees them (that alone removes the crash and the corruption; for Qwen3.5 weights in HF
    layout one ``mtp.`` tensor still goes along, so stock's "HF checkpoint: shift the norms"
    decision - which it bases on them - stays its own; for the DeepSeek-V3 layout the layers
    past ``num_hidden_layers`` are set aside and run through the release's own ``sanitize``
    under an index it processes, so the head's experts, latent attention and fp8 weights are
    converted exactly as the backbone's), and wrap
    ``mlx_lm.utils.load_model`` - the function every load path goes through - to build the head
    from the family's own blocks (``mtp_families``), convert the tensors to mlx-lm's layout (per
    tensor: key prefixes, per-expert/fused/stacked experts, zero-centred or shifted Qwen norms),
    quantize exactly the layers stored quantized (per-layer entries of ``config["quantization"]``
    first, else the stored shapes), and load it strictly. The head is attached as ``model.mtp``
    outside the parameter tree (``revert()`` takes the decoding interface and its class swap off
    the models loaded meanwhile; the head itself stays, as loaded data); ``model.mtp_status`` says
    what happened (kept, no head, declared
    but missing, which tensors are missing, what this mlx-lm cannot build - e.g. a Nemotron-H
    MoE block before 0.30.0 - or not kept for this family).

Affected
    Every supported release (0.28.4 - 0.32.2); the probe decides on newer ones.

Upstream
    https://github.com/ml-explore/mlx-lm/blob/v0.32.2/mlx_lm/models/qwen3_next.py (``sanitize``);
    https://github.com/ml-explore/mlx-lm/blob/v0.31.3/mlx_lm/models/qwen3_5.py (norm shift);
    https://github.com/ml-explore/mlx-lm/blob/v0.32.2/mlx_lm/models/deepseek_v3.py (``layers.61``);
    https://github.com/ml-explore/mlx-lm/pull/990 (MTP support, open).

Retire
    When mlx-lm keeps MTP heads itself in every supported release.

Metal
    Loading only; no kernel involved.
"""

from mlx_lm_patches.engine.contract import NotNeeded, Outcome

UTILS = "mlx_lm.utils"


def _sanitize_without_mtp(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.mtp.families import family_of
    from mlx_lm_patches.mechanisms.mtp.heads import SOURCE, for_stock_sanitize, split, stash

    weights = args[0] if args else kwargs.pop("weights")
    backbone, mtp = split(weights)
    family = family_of(instance)
    if hasattr(family, "sanitize_head") and mtp:  # the release's own conversion (e.g. fp8) for the head too
        mtp = family.sanitize_head(instance, mtp, lambda w: wrapped(w, *args[1:], **kwargs))
    if hasattr(family, "split_checkpoint"):  # the head is a layer past the backbone's last
        backbone, layer = family.split_checkpoint(instance, backbone, lambda w: wrapped(w, *args[1:], **kwargs))
        if layer:
            instance.__dict__[SOURCE] = family.source(instance)
        mtp = dict(mtp, **layer)
    if instance is not None:
        stash(instance, mtp)
    return wrapped(for_stock_sanitize(instance, backbone, mtp), *args[1:], **kwargs)


def _load_model_with_mtp(wrapped, instance, args, kwargs, track=None):
    from mlx_lm_patches.mechanisms.mtp.heads import attach

    model, config = wrapped(*args, **kwargs)
    model_path = args[0] if args else kwargs.get("model_path")
    lazy = args[1] if len(args) > 1 else kwargs.get("lazy", False)
    attach(model, model_path, config, lazy=lazy)
    from mlx_lm_patches.mechanisms.mtp.families import family_of

    if family_of(model) is not None:
        from mlx_lm_patches.mechanisms.mtp.decoding import add_interface

        add_interface(model, track)
    return model, config


# Families whose Model subclasses another kept family's (glm_moe_dsa: deepseek_v32's), so that
# their sanitize and shard may be inherited (then already wrapped there).
SUBCLASSED_FAMILIES = ("glm_moe_dsa",)

# Families whose Model.shard (tensor parallelism) the head's layers go through too (where defined).
SHARDED_FAMILIES = ("qwen3_5", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "exaone_moe",
                    "step3p5", "longcat_flash", "longcat_flash_ngram")


def _shard_with_head(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.calls import bind_arguments
    from mlx_lm_patches.mechanisms.mtp.sharding import shard_head

    result = wrapped(*args, **kwargs)
    function = getattr(wrapped, "__func__", None)
    if function is None:  # called through the class by another family's shard (LongCat-Flash-Lite's
        return result     # calls LongcatFlashLM.shard(self, group)): the outer call splits the head
    shard_head(function, instance, bind_arguments(wrapped, args, kwargs).arguments.get("group"))
    return result


def probe():
    try:
        from mlx_lm.models import qwen3_next
    except ImportError:
        return NotNeeded("qwen3_next (mlx_lm.models.qwen3_next) missing in this mlx-lm: not needed")

    if hasattr(qwen3_next.Model, "mtp_forward") or hasattr(qwen3_next.Model, "mtp"):
        return None
    return "qwen3_next has no MTP module: MTP tensors crash the load or are dropped"


def apply(p):
    import importlib.util

    from mlx_lm_patches.mechanisms.mtp.families import FAMILIES

    for family in sorted(FAMILIES):  # every family whose head is kept (its sanitize is a declared target)
        if importlib.util.find_spec(f"mlx_lm.models.{family}") is None:
            continue
        if family in SUBCLASSED_FAMILIES:  # its own sanitize if it has one, else its base's (wrapped)
            p.wrap_if_present(f"mlx_lm.models.{family}:Model.sanitize", _sanitize_without_mtp, own=True)
        else:
            p.wrap(f"mlx_lm.models.{family}:Model.sanitize", _sanitize_without_mtp)
    for family in SHARDED_FAMILIES:  # the head's layers sharded as the backbone's
        if importlib.util.find_spec(f"mlx_lm.models.{family}") is not None:
            p.wrap_if_present(f"mlx_lm.models.{family}:Model.shard", _shard_with_head, own=True)
    track = p.track  # revert takes the interface (and the draft's class swap) off loaded models

    def load_model(wrapped, instance, args, kwargs):
        return _load_model_with_mtp(wrapped, instance, args, kwargs, track)

    p.wrap(f"{UTILS}:load_model", load_model)


def scenario():
    """A Qwen3-Next checkpoint carrying an MTP head loads; head and backbone round-trip."""
    import tempfile

    from mlx_lm_patches.demos.mtp_checkpoints import check_loaded, write_mtp_checkpoint

    from mlx_lm import load

    details = []
    with tempfile.TemporaryDirectory() as tmp:
        for form in ("mlx", "hf"):
            written = write_mtp_checkpoint(tmp, "qwen3_next", form=form)
            try:
                model, _ = load(str(written.folder))
            except Exception as exc:
                return Outcome.failure(f"qwen3_next {form}-format checkpoint with an MTP head", exc)
            problem = check_loaded(model, written)
            if problem:
                return Outcome.failure(f"qwen3_next {form}-format checkpoint: {problem}")
            details.append(f"qwen3_next {form} format: backbone intact, all MTP tensors kept")
    return Outcome(True, "MTP heads kept at load; backbone intact", details)

