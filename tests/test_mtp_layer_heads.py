"""MTP heads that are one more decoder layer of the family: the DeepSeek-V3 layout (DeepSeek-V3,
DeepSeek-V3.2, GLM-4.5/4.6/4.7 = glm4_moe, GLM-4.7-Flash = glm4_moe_lite: the checkpoint's layer
``model.layers.{num_hidden_layers}``), MiMo (``model.mtp_layers.0``) and ERNIE 4.5 MoE
(``model.mtp_emb_norm.0``, ``model.mtp_hidden_norm.0``, ``model.mtp_linear_proj.0``,
``model.mtp_block.0``). Tiny checkpoints
written to disk in the Hugging Face layout (for the DeepSeek-V3 layout: experts per expert,
multi-head latent attention's ``kv_b_proj`` unsplit, copies of the shared embedding and output
head) and in mlx-lm's layout (``mtp.*``):

* with the package the head is kept, converted exactly as the release converts the backbone's
  layers, and ``mtp_status`` says where it came from and that the shared copies are not loaded;
* stock mlx-lm (fresh interpreter, ``MLX_LM_PATCHES=0``) fails to load deepseek_v3 of this depth
  (its ``sanitize`` drops layer 61 only) and drops the other heads: a strict xfail;
* the head's wiring, which exactness cannot show (a wrongly wired head only lowers acceptance):
  with weights that make its proposal derivable - the fusion projection passing the hidden half
  only (second for the DeepSeek-V3 layout, first for MiMo), the
  decoder layer's output projections zero (the layer is the identity through its residuals),
  unit norms - the draft's first proposal of every round is the main model's own prediction
  from the hidden state of the last committed position, token by token.

Exactness of MTP speculation for these families is in ``test_mtp_decoding.py`` and
``test_mtp_head_reference.py``, conversion in ``test_mtp_convert.py``."""

import importlib.util
import json

import pytest

from conftest import run_python, xfail_if_affected
from mlx_lm_patches.selftest.mtp_checkpoints import (MTP_MODEL_TYPES, check_loaded, hf_layout_unreadable,
                                                     write_mtp_checkpoint)
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
from mlx_lm_patches.selftest.scenarios import greedy
from mlx_lm_patches.selftest.tiny_models import build_tiny_model
from mlx_lm_patches.mechanisms.mtp.families import FAMILIES as REGISTERED
from mlx_lm_patches.mechanisms.mtp.families._extra_layer import ExtraLayerHead



@pytest.fixture(autouse=True)
def _fixed_draft_length(monkeypatch):
    """Proposals are followed round by round at a fixed ``num_draft_tokens``: adaptive drafting
    off (its schedules are tested in test_adaptive_drafting.py)."""
    from mlx_lm_patches.engine import env

    monkeypatch.setenv(env.ADAPTIVE_DRAFTING, "0")

# every registered family whose head is one more decoder layer, that this mlx-lm has
FAMILIES = [f for f in MTP_MODEL_TYPES if isinstance(REGISTERED[f], ExtraLayerHead)
            and importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]
pytestmark = pytest.mark.skipif(not FAMILIES, reason="this mlx-lm has none of these families")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-layout")
    cache = {}

    def get(family, form):
        unreadable = hf_layout_unreadable(family) if form == "hf" else None
        if unreadable:
            pytest.skip(unreadable)
        if (family, form) not in cache:
            cache[family, form] = write_mtp_checkpoint(root, family, form=form, dtype="float32")
        return cache[family, form]

    return get


@pytest.mark.parametrize("form", ["hf", "mlx"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_the_head_is_kept_exactly(written, family, form):
    from mlx_lm import load

    checkpoint = written(family, form)
    model = load(str(checkpoint.folder))[0]
    assert check_loaded(model, checkpoint) is None, check_loaded(model, checkpoint)
    if form == "hf" and family == "mimo":
        assert model.mtp_status.endswith("from the checkpoint's model.mtp_layers"), model.mtp_status
    elif form == "hf" and family == "ernie4_5_moe":
        assert model.mtp_status.endswith("from the checkpoint's model.mtp_* tensors"), model.mtp_status
    elif family == "mimo_v2_flash":  # model.mtp.layers.{0,1,2}: one per draft step
        assert model.mtp_status.startswith("MTP head kept: 3 MTP layers (draft step k with layer k, "
                                           "each fed the model's hidden state)"), model.mtp_status
    elif family == "step3p5":  # model.layers.{3,4}: one per draft step, each with its own output head
        assert model.mtp_status.startswith("MTP head kept: 2 MTP layers (draft step k with layer k, "
                                           "each fed the previous one's output)"), model.mtp_status
        source = "layer model.layers.3" if form == "hf" else "mtp.* keys"
        assert model.mtp_status.endswith(f"from the checkpoint's {source}"), model.mtp_status
    elif form == "hf" and family in ("longcat_flash", "longcat_flash_ngram"):  # model.mtp.*, its copy of the embedding not loaded
        assert model.mtp_status.endswith("from the checkpoint's mtp.* keys; embedding and output head shared with "
                                         "the model (the checkpoint's 1 copies of them not loaded)"), model.mtp_status
    elif form == "hf" and family == "bailing_moe_v3":  # model.layers.4, no copies of the shared parts
        assert model.mtp_status.endswith("from the checkpoint's layer model.layers.4"), model.mtp_status
    elif form == "hf" and family != "exaone_moe":  # (exaone_moe's head: mtp.* keys, both forms)
        assert "from the checkpoint's layer model.layers.3; embedding and output head shared with the model " \
               "(the checkpoint's 2 copies of them not loaded)" in model.mtp_status, model.mtp_status
    else:
        assert model.mtp_status.endswith("from the checkpoint's mtp.* keys"), model.mtp_status


STOCK = """
import json, sys
from mlx_lm import load
out = {}
for folder in sys.argv[1:]:
    try:
        model, _ = load(folder)
        out[folder] = "loaded, head " + ("kept" if getattr(model, "mtp", None) is not None else "dropped")
    except Exception as exc:
        out[folder] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def stock_loads(written):
    folders = {family: str(written(family, "hf").folder) for family in FAMILIES if not hf_layout_unreadable(family)}
    ran = run_python(STOCK, *folders.values(), env={"MLX_LM_PATCHES": "0"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    outcome = json.loads(ran.stdout.strip().splitlines()[-1])
    return {family: outcome[folder] for family, folder in folders.items()}


@pytest.mark.subprocess
@pytest.mark.parametrize("family", [pytest.param(f, marks=xfail_if_affected("mtp-heads-kept")) for f in FAMILIES])
def test_stock_mlx_lm_keeps_the_head(stock_loads, family):
    """deepseek_v3: "Received ... parameters not in model" (its sanitize removes layer 61, not the
    layer after this checkpoint's last); glm4_moe, glm4_moe_lite, mimo: the head is dropped."""
    if family not in stock_loads:
        pytest.skip(hf_layout_unreadable(family))
    assert stock_loads[family] == "loaded, head kept", stock_loads[family]


def _derivable(model):
    """Set the head's weights so that its output is proportional to the main model's post-norm
    hidden state: its logits' argmax is then the main model's own prediction."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    head, hidden = model.mtp, model.args.hidden_size
    # the documented names and order (module docstring), read directly, not through mechanisms/mtp/families/
    if model.model_type == "mimo":  # input_proj(concat[hidden_layernorm(h), token_layernorm(e)])
        projection, norms, hidden_first = head.input_proj, (head.token_layernorm, head.hidden_layernorm,
                                                            head.final_layernorm), True
    elif model.model_type == "ernie4_5_moe":  # mtp_linear_proj(concat[mtp_emb_norm(e), mtp_hidden_norm(h)])
        projection, norms, hidden_first = head.mtp_linear_proj, (head.mtp_emb_norm, head.mtp_hidden_norm), False
    elif model.model_type == "exaone_moe":  # fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]), norm
        projection, norms, hidden_first = head.fc, (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden,
                                                    head.norm), False
    elif model.model_type == "step3p5":  # eh_proj(concat[enorm(e), hnorm(h_pre)]), its own shared_head
        # h is the main model's hidden state before its final norm: the head's norm is that norm
        # and its output head the model's, so the head predicts what the model does
        projection, norms, hidden_first = head.eh_proj, (head.enorm, head.hnorm), False
        head.shared_head.norm.weight = model.model.norm.weight
        head.shared_head.output.weight = model.lm_head.weight
    elif model.model_type in ("mimo_v2_flash", "bailing_moe_v3"):  # eh_proj(concat[enorm(e), hnorm(h)]), final_layernorm
        projection, norms, hidden_first = head.eh_proj, (head.enorm, head.hnorm, head.final_layernorm), False
    elif model.model_type in ("longcat_flash", "longcat_flash_ngram"):  # eh_proj(concat[enorm.m(e), hnorm.m(h)]), model.mtp.norm
        projection, norms, hidden_first = head.eh_proj, (head.enorm, head.hnorm, head.norm), False
    else:  # eh_proj(concat[enorm(e), hnorm(h)]), then shared_head.norm
        projection, norms, hidden_first = head.eh_proj, (head.enorm, head.hnorm, head.shared_head.norm), False
    halves = [mx.eye(hidden), mx.zeros((hidden, hidden))]  # [hidden | embedding]
    projection.weight = mx.concatenate(halves if hidden_first else halves[::-1], axis=1)
    for norm in norms:
        norm.weight = mx.ones((hidden,))
    updates = [(path, mx.zeros_like(value)) for path, value in tree_flatten(head.layers[0].parameters())
               if any(out in f".{path}" for out in (".o_proj.", ".dense.", ".down_proj."))]  # attention and (shared) experts out
    head.layers[0].load_weights(updates, strict=False)
    mx.eval(head.parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.family_sweep(MTP_MODEL_TYPES)
def test_a_derivable_head_proposes_the_main_models_prediction(written, family):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step

    from support.mtp_drafts import recording_draft

    model = load(str(written(family, "hf").folder))[0]
    _derivable(model)
    proposals = []
    prompt = prompt_tokens(15, seed=9)
    steps = list(speculative_generate_step(mx.array(prompt), model, recording_draft(model, proposals),
                                           num_draft_tokens=2, max_tokens=12))
    sequence = prompt + [int(t) for t, _, _ in steps]
    assert [int(t) for t, _, _ in steps] == greedy(model, prompt, max_tokens=12).tokens
    predicted = mx.argmax(model(mx.array(sequence)[None])[0], axis=-1).tolist()  # at each position
    assert len(proposals) >= 4
    for committed, row in proposals:
        # the head read h_{C-1} and x_C: it must propose what the main model predicts from h_{C-1}
        proposal = int(mx.argmax(row).item())
        assert proposal == predicted[committed - 1], (committed, proposal, predicted[committed - 1])


@pytest.mark.skipif("exaone_moe" not in FAMILIES, reason="this mlx-lm has no exaone_moe")
def test_a_sliding_window_exaone_mtp_layer_is_kept_and_speculation_stays_greedy(tmp_path):
    """K-EXAONE with ``mtp_layer_types: ["sliding_attention"]``: the head is kept (its layer over a
    plain, trimmable cache with a window mask) and drafting with it gives greedy decoding's
    tokens."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step

    written = write_mtp_checkpoint(tmp_path, "exaone_moe", dtype="float32")
    config_path = written.folder / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_layer_types"] = ["sliding_attention"]
    config_path.write_text(json.dumps(config))
    model = load(str(written.folder))[0]
    assert model.mtp is not None and model.mtp.layers[0].is_sliding_window, model.mtp_status
    prompt = prompt_tokens(12, seed=4)
    steps = list(speculative_generate_step(mx.array(prompt), model, model.make_draft_model(),
                                           num_draft_tokens=2, max_tokens=10))
    assert [int(t) for t, _, _ in steps] == greedy(model, prompt, max_tokens=10).tokens


@pytest.mark.skipif("mimo_v2_flash" not in FAMILIES, reason="this mlx-lm has no mimo_v2_flash")
def test_an_fp8_mimo_v2_head_is_dequantized_as_the_release_dequantizes_the_backbone(tmp_path):
    """MiMo-V2-Flash checkpoints are fp8 (``weight`` plus a block ``weight_scale_inv``), MTP
    tensors included. Stock ``sanitize`` dequantizes every such pair, then drops the head: the
    head's pairs go through that same code (as backbone layer 0), so the kept head holds exactly
    what the release makes of them."""
    import inspect

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models import mimo_v2_flash

    if "weight_scale_inv" not in inspect.getsource(mimo_v2_flash.Model.sanitize):
        pytest.skip("this release's mimo_v2_flash sanitize reads no fp8 tensors")
    if not hasattr(mx, "from_fp8"):
        pytest.skip("this mlx has no fp8 conversion (the release's own sanitize cannot read fp8 either)")
    written = write_mtp_checkpoint(tmp_path, "mimo_v2_flash", form="hf", dtype="float32")
    (path,) = written.folder.glob("model*.safetensors")
    tensors = mx.load(str(path))
    mx.eval(list(tensors.values()))  # read it all before the file is rewritten below
    fp8 = {}
    for key in ("model.mtp.layers.0.eh_proj.weight", "model.mtp.layers.0.self_attn.q_proj.weight"):
        stored = mx.to_fp8(tensors[key] * 4.0)
        scale = mx.full(((tensors[key].shape[0] + 127) // 128, (tensors[key].shape[1] + 127) // 128), 0.25)
        tensors[key], tensors[key.replace(".weight", ".weight_scale_inv")] = stored, scale
        fp8[key] = (stored, scale)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})
    model = load(str(written.folder))[0]
    assert model.mtp is not None, model.mtp_status
    stock = build_tiny_model("mimo_v2_flash", seed=0)
    for key, (stored, scale) in fp8.items():
        expected = stock.sanitize({"model.layers.0.x.weight": stored, "model.layers.0.x.weight_scale_inv": scale})
        got = model.mtp.eh_proj.weight if "eh_proj" in key else model.mtp.layers[0].self_attn.q_proj.weight
        assert mx.array_equal(got, expected["model.layers.0.x.weight"].astype(got.dtype)).item(), key


@pytest.mark.skipif("bailing_moe_v3" not in FAMILIES, reason="this mlx-lm has no bailing_moe_v3")
def test_a_ling_3_checkpoint_named_bailing_hybrid_keeps_its_head_and_drafts_greedy(tmp_path):
    """Ling / Ring 3.0 checkpoints name themselves ``bailing_hybrid`` (mlx-lm tells them apart from
    its other ``bailing_hybrid`` module by ``architectures``): the HF-layout tiny checkpoint with
    that name loads through mlx-lm's ``bailing_moe_v3``, keeps its head, and MTP speculation
    (``--draft-model mtp``'s draft) equals greedy decoding."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step

    written = write_mtp_checkpoint(tmp_path, "bailing_moe_v3", form="hf", dtype="float32")
    config_path = written.folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"])
    config_path.write_text(json.dumps(config))
    model = load(str(written.folder))[0]
    assert type(model).__module__ == "mlx_lm.models.bailing_moe_v3" and model.model_type == "bailing_hybrid"
    assert model.mtp is not None, model.mtp_status
    assert check_loaded(model, written) is None
    prompt = prompt_tokens(15, seed=4)
    steps = list(speculative_generate_step(mx.array(prompt), model, model.make_draft_model(),
                                           num_draft_tokens=2, max_tokens=12))
    assert [int(t) for t, _, _ in steps] == greedy(model, prompt, max_tokens=12).tokens
