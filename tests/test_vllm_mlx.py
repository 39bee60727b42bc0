"""vllm-mlx's text engine on hybrid models: continuous batching equals each prompt alone.

vllm-mlx (0.6.0 pins mlx-lm 0.31.x) serves text models with ``BatchedEngine``: its scheduler
drives mlx-lm's ``BatchGenerator``, so requests of different lengths are prefilled and decoded
together, and mlx-lm's batching bugs reach its users (the CI matrix has a row with vllm-mlx;
elsewhere this file is skipped). Tiny random-weight models written to disk; reference: greedy
decoding of each prompt alone, cold, through mlx-lm's ``stream_generate``
(``support.chat_reference``). Checked through the engine's public ``generate`` (six concurrent
requests of 3 to 40 tokens) and through its OpenAI-compatible server over HTTP
(``python -m vllm_mlx.server --continuous-batching``, concurrent chat completions).

Stock: the patches a family needs disabled, a strict xfail where the matrix says the installed
mlx-lm is affected (qwen3_5 masks its padding and needs ``batch-mask-lengths``; nemotron_h's
recurrent layers ignore padding and need ``batch-prefill-per-row``).
"""

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm_mlx")

import mlx_lm_patches  # noqa: E402
from conftest import clean_env, run_python, xfail_if_affected  # noqa: E402
from mlx_lm_patches.selftest import vllm_mlx_engine  # noqa: E402
from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens  # noqa: E402
from mlx_lm_patches.selftest.tiny_models import HYBRID_MODEL_TYPES  # noqa: E402
from support import image_batches  # noqa: E402

PROMPT_LENGTHS = (3, 17, 40, 9, 25, 5)
MAX_TOKENS = 10
ROWS = {row.id: row for row in mlx_lm_patches.apply()}
TESTS = os.path.dirname(os.path.abspath(__file__))
# family -> (the patch its batched answers need on the installed mlx-lm, the patches disabled for
# the stock run): per-row prefill also hides batch-mask-lengths' bug, so qwen3_5 goes without both
STOCK = {"qwen3_5": ("batch-mask-lengths", ["batch-mask-lengths", "batch-prefill-per-row"]),
         "nemotron_h": ("batch-prefill-per-row", ["batch-prefill-per-row"])}


def _families():
    for model_type in HYBRID_MODEL_TYPES:
        module = model_type.replace("-", "_")
        if importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
            continue
        yield model_type


class Folder:
    """A tiny model written to disk, loaded once for the references."""

    def __init__(self, root, model_type):
        from mlx_lm import load

        from mlx_lm_patches.selftest.model_folder import write_model_folder
        from mlx_lm_patches.selftest.tiny_models import build_tiny_model, tiny_config

        self.model_type = model_type
        # the path must not contain "qwen3": vllm-mlx then makes <|im_end|> the eos token
        self.path = write_model_folder(os.path.join(root, "model"), build_tiny_model(model_type, seed=1),
                                       tiny_config(model_type))
        self.model, self.tokenizer = load(str(self.path))
        self._memo = {}

    def reference(self, prompt):
        from support.chat_reference import token_reference

        key = tuple(prompt)
        if key not in self._memo:
            self._memo[key] = token_reference(self.model, self.tokenizer, prompt, MAX_TOKENS)
        return self._memo[key]


@pytest.fixture(scope="module", params=list(_families()))
def folder(request, tmp_path_factory):
    return Folder(tmp_path_factory.mktemp("family"), request.param)


def _engine_answers(path, prompts, **engine_options):
    """Every prompt (token ids) sent at once to a started ``BatchedEngine(path,
    **engine_options)``; its outputs (``vllm_mlx_engine.engine_answers``)."""
    return vllm_mlx_engine.engine_answers(path, [(list(p), None) for p in prompts], MAX_TOKENS, **engine_options)[0]


def _problem(folder, prompts, answers):
    """The first answer whose tokens differ from its prompt's reference, or None."""
    for prompt, answer in zip(prompts, answers):
        ref = folder.reference(prompt)
        got = _generated(answer, ref)
        if got != ref.tokens:
            return (f"{folder.model_type}: prompt of {len(prompt)} tokens batched gave {got}, "
                    f"alone {ref.tokens}")
    return None


def _generated(answer, ref):
    """The engine's tokens without the eos that ended the reference (the reference leaves it out)."""
    got = [int(t) for t in answer.tokens]
    return got[:-1] if ref.eos is not None and got[-1:] == [ref.eos] else got


def _prompts():
    return [prompt_tokens(n, seed=n) for n in PROMPT_LENGTHS]


def test_batched_engine_equals_each_prompt_alone(folder):
    prompts = _prompts()
    assert _problem(folder, prompts, _engine_answers(folder.path, prompts)) is None


@pytest.mark.subprocess
@pytest.mark.parametrize("model_type,patch_id,disabled", [
    pytest.param(model_type, patch_id, disabled, id=f"{model_type}-without-{'+'.join(disabled)}",
                 marks=xfail_if_affected(patch_id))
    for model_type, (patch_id, disabled) in STOCK.items()])
def test_stock_batched_engine_is_wrong_where_affected(model_type, patch_id, disabled, tmp_path_factory):
    """In a fresh interpreter with ``MLX_LM_PATCHES_DISABLE`` naming the patches (not reverted in
    this one: patches applied in a process, e.g. the prefix reuse's model wrappers, stay)."""
    if ROWS[patch_id].state != "applied":
        pytest.skip(f"{patch_id} is {ROWS[patch_id].state} here")
    ran = run_python(f"""
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import test_vllm_mlx as here
        folder = here.Folder({str(tmp_path_factory.mktemp("stock"))!r}, {model_type!r})
        prompts = here._prompts()  # references are single sequences: the disabled patches batch
        print(json.dumps(here._problem(folder, prompts, here._engine_answers(folder.path, prompts))))
    """, env={"MLX_LM_PATCHES_DISABLE": ",".join(disabled)}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) is None


def _one_family_per_cache_layout():
    from support.sweeps import representatives

    return list(representatives(tuple(_families())))


@pytest.mark.subprocess
@pytest.mark.parametrize("model_type", _one_family_per_cache_layout())
def test_server_concurrent_chats_equal_the_references(model_type, tmp_path_factory):
    """``python -m vllm_mlx.server --continuous-batching`` (the package activated by its
    ``.pth``), chats of different lengths sent concurrently by the ``openai`` client: each
    answer equals greedy decoding of its chat prompt alone - for one hybrid family per cache
    layout of the installed mlx-lm (every family goes through vllm-mlx's batched engine in
    process: test_batched_engine_equals_each_prompt_alone)."""
    from support.chat_reference import chat_prompt
    from support.server import serve

    folder = Folder(tmp_path_factory.mktemp("served"), model_type)
    chats = [[{"role": "user", "content": " ".join(["tell me about the river"] * n)}] for n in (1, 4, 9, 2, 6)]
    want = [folder.reference(chat_prompt(folder.tokenizer, chat)) for chat in chats]
    env = clean_env(HF_HUB_OFFLINE="1")
    with serve(folder.path, "--continuous-batching", "--max-tokens", str(MAX_TOKENS), env=env,
               entry=("-m", "vllm_mlx.server")) as server:
        client = server.client()
        (served,) = [m.id for m in client.models.list().data]

        def ask(chat):
            reply = client.chat.completions.create(model=served, messages=chat, max_tokens=MAX_TOKENS,
                                                   temperature=0.0)
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(chats)) as pool:
            got = list(pool.map(ask, chats))
        tail = server.log_tail()
    from vllm_mlx.api.utils import clean_output_text

    for chat, ref, text in zip(chats, want, got):  # (the server strips special tokens and whitespace)
        assert text == clean_output_text(ref.text), json.dumps({"chat": chat, "want": ref.text, "got": text,
                                                                "log": tail})


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_enable_mtp_answers_equal_greedy(family, tmp_path_factory):
    """vllm-mlx's own MTP (``SchedulerConfig(enable_mtp=True)``, its ``--enable-mtp``) on a
    checkpoint with its head in vllm-mlx's ``model-mtp.safetensors``, with the package installed
    (``mtp-heads-kept`` keeps that head as ``model.mtp`` too): concurrent requests still equal
    greedy decoding of each prompt alone. (vllm-mlx 0.6.0 turns its MTP off on mlx-lm 0.31.x,
    whose ``BatchGenerator`` lacks the ``_step`` it hooks, so the engine decodes without drafts.)"""
    from mlx_lm import load
    from vllm_mlx.scheduler import SchedulerConfig

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
    from support.chat_reference import token_reference

    written = write_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), family, placement="model-mtp",
                                   dtype="float32", name="model")  # no "qwen3" in the path (see Folder)
    model, tokenizer = load(str(written.folder))
    assert model.mtp is not None, model.mtp_status
    prompts = _prompts()
    want = [token_reference(model, tokenizer, prompt, MAX_TOKENS) for prompt in prompts]

    answers = _engine_answers(written.folder, prompts, scheduler_config=SchedulerConfig(enable_mtp=True))
    for prompt, ref, answer in zip(prompts, want, answers):
        got = _generated(answer, ref)
        assert got == ref.tokens, (len(prompt), got, ref.tokens, answer.mtp_drafts)


MTP_FORWARD_PATCH = "vllm-mlx-qwen3-5-mtp-forward-kept"


def test_vision_engine_enable_mtp_answers_equal_greedy(tmp_path):
    """vllm-mlx's own MTP on its vision engine (``SchedulerConfig(enable_mtp=True)``, its
    ``--enable-mtp``) over a tiny mlx-vlm Qwen3.5 folder carrying its ``model-mtp.safetensors``:
    three image requests and a text request sent at once give each request's greedy tokens
    alone through mlx-vlm's ``generate_step``, and the head drafts (every draft is verified and,
    the head's weights being random, rolled back)."""
    if not vllm_mlx_engine.available("qwen3_5"):
        pytest.skip("mlx-vlm's qwen3_5 or vllm-mlx's vision engine is not installed")
    problem, stats = vllm_mlx_engine.enable_mtp_problem(str(tmp_path))
    assert problem is None
    assert stats.get("attempted", 0) > 0 and stats.get("errors") == 0, stats


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(MTP_FORWARD_PATCH, marks=xfail_if_affected(MTP_FORWARD_PATCH))])
def test_stock_vision_engine_enable_mtp_is_wrong_where_affected(pid, tmp_path):
    """The same without the patch (fresh interpreter, ``MLX_LM_PATCHES_DISABLE``): vllm-mlx's
    injected forward drops the images - a strict xfail where the matrix says the installed
    vllm-mlx is affected."""
    ran = run_python(f"""
        import json
        from mlx_lm_patches.selftest import vllm_mlx_engine
        print(json.dumps(vllm_mlx_engine.enable_mtp_problem({str(tmp_path)!r})[0]))
    """, env={"MLX_LM_PATCHES_DISABLE": pid}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) is None


# -- the vision engine (MLLMBatchGenerator over an mlx-vlm model) ------------------------------

VISION_PATCH = "vllm-mlx-qwen3-5-attention-kept"


def tiny_vlm_model_types():
    from mlx_lm_patches.selftest.vlm.batching import MODEL_TYPES

    return MODEL_TYPES


@pytest.mark.parametrize("model_type", vllm_mlx_engine.MODEL_TYPES)
def test_vision_engine_text_requests_equal_each_alone(model_type):
    """vllm-mlx's ``MLLMBatchGenerator`` (what it serves vision-language checkpoints with) on a
    tiny mlx-vlm model: text requests of 3, 17 and 9 tokens sent at once give each request's
    greedy tokens and log-probabilities (within 1e-4) of the prompt alone through mlx-vlm's
    ``generate_step``."""
    from mlx_lm_patches.mechanisms.probing import tiny_vlm

    if not vllm_mlx_engine.available(model_type):
        pytest.skip(f"mlx-vlm's {model_type} or vllm-mlx's vision engine is not installed")
    assert vllm_mlx_engine.batched_problem(tiny_vlm.build(model_type), model_type) is None


@pytest.mark.parametrize("model_type", tiny_vlm_model_types())
def test_vision_engine_image_requests_equal_each_alone(model_type):
    """vllm-mlx's ``MLLMBatchGenerator`` with mlx-vlm's own processor (over a locally built
    tokenizer): three chat requests with an image each (base64 data URLs, as an OpenAI client
    sends them; prompts of different lengths) and a text request sent at once: each request's
    greedy tokens and log-probabilities (within 1e-4) equal its prompt and image alone through
    mlx-vlm's ``generate_step``."""
    from mlx_lm_patches.mechanisms.probing import tiny_vlm

    if not vllm_mlx_engine.available(model_type):
        pytest.skip(f"mlx-vlm's {model_type} or vllm-mlx's vision engine is not installed")
    model = tiny_vlm.build(model_type, images=True)
    assert image_batches.image_requests_problem(model, model_type) is None


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(VISION_PATCH, marks=xfail_if_affected(VISION_PATCH))])
def test_stock_vision_engine_is_wrong_where_affected(pid):
    """Without the patch (fresh interpreter, ``MLX_LM_PATCHES_DISABLE``) vllm-mlx's own attention
    replacement decodes the shorter rows over their padding: a strict xfail where the matrix
    says the installed vllm-mlx is affected."""
    ran = run_python("""
        import json
        from mlx_lm_patches.mechanisms.probing import tiny_vlm
        from mlx_lm_patches.selftest import vllm_mlx_engine
        print(json.dumps(vllm_mlx_engine.batched_problem(tiny_vlm.build("qwen3_5"), "qwen3_5")))
    """, env={"MLX_LM_PATCHES_DISABLE": pid}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) is None


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(VISION_PATCH, marks=xfail_if_affected(VISION_PATCH))])
def test_stock_vision_engine_image_requests_are_wrong_where_affected(pid):
    """The image requests of ``test_vision_engine_image_requests_equal_each_alone`` on Qwen3.5
    without the patch (fresh interpreter): a strict xfail where the matrix says the installed
    vllm-mlx is affected."""
    ran = run_python("""
        import json
        from mlx_lm_patches.mechanisms.probing import tiny_vlm
        from mlx_lm_patches.selftest import vllm_mlx_engine
        from support.image_batches import image_requests_problem
        model = tiny_vlm.build("qwen3_5", images=True)
        print(json.dumps(image_requests_problem(model, "qwen3_5")))
    """, env={"MLX_LM_PATCHES_DISABLE": pid, "PYTHONPATH": TESTS}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) is None


IMAGE_CHAT_TOKENS = 40  # long enough for the concurrent chats' decoding to overlap, even under load (24 did not once)
IMAGE_CHAT_ROUNDS = 3  # the chats are sent at once this many times: whether the server batches
# them depends on when they arrive, so a round may run them one after another


def _image_chats_served(folder, env):
    """:func:`vllm_mlx_engine.image_requests` as OpenAI chats (images as base64 data URLs) sent
    concurrently by the ``openai`` client to ``python -m vllm_mlx.server --continuous-batching``
    serving ``folder``, :data:`IMAGE_CHAT_ROUNDS` times; the answers of each round, in order,
    and the server's log tail."""
    from support.server import serve

    def chat(text, images):
        if not images:
            return [{"role": "user", "content": text}]
        parts = [{"type": "image_url", "image_url": {"url": vllm_mlx_engine.image_data_url(i)}} for i in images]
        return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]

    items = vllm_mlx_engine.image_requests()
    with serve(folder, "--continuous-batching", "--max-tokens", str(IMAGE_CHAT_TOKENS), env=env,
               entry=("-m", "vllm_mlx.server")) as server:
        client = server.client()
        (served,) = [m.id for m in client.models.list().data]

        def ask(item):
            reply = client.chat.completions.create(model=served, messages=chat(*item),
                                                   max_tokens=IMAGE_CHAT_TOKENS, temperature=0.0)
            return reply.choices[0].message.content

        rounds = []
        with ThreadPoolExecutor(len(items)) as pool:
            for _ in range(IMAGE_CHAT_ROUNDS):
                rounds.append(list(pool.map(ask, items)))
        return rounds, server.log_tail()


def _image_chats_problem(model_type, root, env):
    """``None`` if in every round each image chat served at once is answered as
    ``mlx_vlm.generate`` answers its prompt and image alone (as the server returns text:
    vllm-mlx's ``clean_output_text`` of it)."""
    import importlib

    from mlx_vlm.prompt_utils import apply_chat_template
    from vllm_mlx.api.utils import clean_output_text

    from mlx_lm_patches.mechanisms.probing import tiny_vlm
    from mlx_lm_patches.selftest.vlm.batch_generate import vision_processor

    generation = importlib.import_module("mlx_vlm.generate")
    folder, model = tiny_vlm.write_model_folder(os.path.join(root, "model"), model_type)
    processor = vision_processor(model_type)
    want = []
    for text, images in vllm_mlx_engine.image_requests():
        model.language_model._position_ids = model.language_model._rope_deltas = None
        formatted = apply_chat_template(processor, model.config, text, num_images=len(images or ()))
        want.append(clean_output_text(generation.generate(model, processor, formatted, image=images,
                                                          max_tokens=IMAGE_CHAT_TOKENS, verbose=False).text))
    rounds, tail = _image_chats_served(folder, env)
    for number, got in enumerate(rounds):
        for i, (ref, text) in enumerate(zip(want, got)):
            if text != ref:
                return json.dumps({"round": number, "request": i, "want": ref, "got": text, "log": tail[-2000:]})
    return None


@pytest.mark.subprocess
@pytest.mark.parametrize("model_type", ["qwen3_5"])
def test_server_image_chats_equal_each_alone(model_type, tmp_path):
    """``python -m vllm_mlx.server --continuous-batching`` on a tiny Qwen3.5 vision-language
    folder (mlx-vlm layout, its own processor over a locally built tokenizer), three chats with
    an image each (different lengths) and a text chat sent concurrently by the ``openai``
    client: each answer equals ``mlx_vlm.generate`` of its prompt and image alone."""
    if not vllm_mlx_engine.available(model_type):
        pytest.skip(f"mlx-vlm's {model_type} or vllm-mlx's vision engine is not installed")
    assert _image_chats_problem(model_type, str(tmp_path), clean_env(HF_HUB_OFFLINE="1")) is None


@pytest.mark.subprocess
@pytest.mark.parametrize("pid", [pytest.param(VISION_PATCH, marks=xfail_if_affected(VISION_PATCH))])
def test_stock_server_image_chats_are_wrong_where_affected(pid, tmp_path):
    """The same chats with the server's vllm-mlx patch disabled (``MLX_LM_PATCHES_DISABLE``): a
    strict xfail where the matrix says the installed vllm-mlx is affected."""
    if not vllm_mlx_engine.available("qwen3_5"):
        pytest.skip("mlx-vlm's qwen3_5 or vllm-mlx's vision engine is not installed")
    env = clean_env(HF_HUB_OFFLINE="1", MLX_LM_PATCHES_DISABLE=pid)
    assert _image_chats_problem("qwen3_5", str(tmp_path), env) is None


@pytest.mark.subprocess
def test_applied_after_vllm_mlx_replaced_the_attention_is_a_clear_error():
    """Applied explicitly after vllm-mlx already replaced mlx-vlm's attention in the process (its
    generator built first, the package off until then): the replacement cannot be undone, so
    ``apply`` raises naming the order to use, instead of reporting a fix that is not there."""
    if ROWS[VISION_PATCH].state != "applied":
        pytest.skip(f"{VISION_PATCH} is {ROWS[VISION_PATCH].state} here")
    ran = run_python(f"""
        from mlx_lm_patches.mechanisms.probing import tiny_vlm
        from mlx_lm_patches.selftest import vllm_mlx_engine
        from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator
        MLLMBatchGenerator(tiny_vlm.build("qwen3_5"), processor=None, enable_vision_cache=False)
        import mlx_lm_patches
        try:
            mlx_lm_patches.apply(only=[{VISION_PATCH!r}])
        except mlx_lm_patches.PatchError as error:
            print("REFUSED", error)
    """, env={"MLX_LM_PATCHES": "0"}, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "REFUSED" in ran.stdout and "before vllm-mlx builds its MLLMBatchGenerator" in ran.stdout, ran.stdout


@pytest.mark.subprocess
def test_vision_engine_built_before_mlx_lm_is_imported_is_exact():
    """As a user script runs it: vllm-mlx's generator module imported first (it does not import
    mlx_lm; the module holding its attention replacement is imported, and the function bound,
    inside ``MLLMBatchGenerator.__init__``, which only then imports mlx_lm). The package activates
    at the first lookup of ``vllm_mlx``, so the fix is in place when the function is bound."""
    ran = run_python("""
        import json, sys
        from vllm_mlx.mllm_batch_generator import MLLMBatchGenerator  # noqa: F401
        early = "mlx_lm" in sys.modules
        from mlx_lm_patches.mechanisms.probing import tiny_vlm
        from mlx_lm_patches.selftest import vllm_mlx_engine
        problem = vllm_mlx_engine.batched_problem(tiny_vlm.build("qwen3_5"), "qwen3_5")
        print(json.dumps([early, problem]))
    """, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    early, problem = json.loads(ran.stdout.strip().splitlines()[-1])
    assert problem is None, (early, problem)
