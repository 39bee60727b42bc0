"""The MTP head split over the ranks the way the model splits its own layers (tensor parallelism).

``Model.shard(group)`` is mlx-lm's tensor parallelism (``sharded_load`` calls it on every rank):
it walks the backbone's decoder layers (``self.layers`` for Qwen3.5, ``self.model.layers`` for
DeepSeek-V3/V3.2, GLM-4.5+, GLM-4.7-Flash, K-EXAONE) and replaces their projections by sharded
ones (``shard_linear`` / ``shard_inplace``: attention heads and MLP or expert columns split, an
``all_sum`` after the output projections), plus family parts (Qwen3.5 splits ``lm_head`` over the
vocabulary). The head kept at load (``model.mtp``) is outside that walk, so it stays whole on
every rank: correct (its input, the final hidden state, is the same on every rank), but every
rank holds and runs all of it.

The head's decoder layers are instances of the family's own layer classes, so the same function
shards them: after the model's own call, it is called once more on a stand-in whose layers are
the head's and whose other parts leave nothing to do (tied embeddings: the shared output head is
not split a second time). The head's fusion projection and norms stay whole on every rank (one
``2h x h`` matrix); its logits come from the model's own output head, gathered as the model
gathers its own. So the head runs the family's sharded code - the same kernels and collectives as
the backbone's layers - and every rank computes the same proposals.

If the family's function cannot run on the stand-in (a later release reading other attributes),
it may have changed part of the head already: the head is then dropped, with the reason in
``model.mtp_status`` - the same on every rank, since every rank runs the same code on the same
shapes, so ``--draft-model mtp`` is refused by all of them.
"""

import types

SHARDED = "_mlx_lm_patches_mtp_sharded"  # on the head: how it was split (never twice)


def _stand_in(layers):
    """What ``Model.shard`` reads, with the head's layers as the model's."""
    text = types.SimpleNamespace(args=types.SimpleNamespace(tie_word_embeddings=True))
    return types.SimpleNamespace(layers=layers, model=types.SimpleNamespace(layers=layers),
                                 language_model=text, args=text.args)


def shard_head(shard_function, model, group) -> None:
    """After ``Model.shard`` split ``model``: split its MTP head's layers with ``shard_function``
    (the family's own ``shard``, unbound) over ``group`` (``None``: the world group), and say so
    in ``model.mtp_status``."""
    import mlx.core as mx

    from mlx_lm_patches.mechanisms.mtp.families import family_of

    head = model.__dict__.get("mtp")
    if head is None or head.__dict__.get(SHARDED):
        return
    group = group or mx.distributed.init()
    status = model.__dict__.get("mtp_status", "MTP head kept")
    try:
        layers = list(head.layers) + [layer for depth in getattr(head, "depths", ()) for layer in depth.layers]
        shard_function(_stand_in(family_of(model).shard_view(layers, group)), group)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the head in an unknown state
        model.__dict__["mtp"] = None
        model.__dict__["mtp_status"] = (f"MTP head dropped: {type(model).__module__}.Model.shard could not "
                                        f"split its layers ({type(exc).__name__}: {exc})")
        return
    how = f"sharded over {group.size()} ranks as the model's own layers (Model.shard)"
    head.__dict__[SHARDED] = how
    model.__dict__["mtp_status"] = f"{status}; {how}"


def sharding_of(model) -> str:
    """How ``model``'s head is spread over the ranks of a distributed load, in words."""
    head = model.__dict__.get("mtp")
    how = head.__dict__.get(SHARDED) if head is not None else None
    return how or "replicated on every rank (not sharded: the model is not tensor-sharded, or its family has no Model.shard)"
