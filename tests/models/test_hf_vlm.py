"""A VLA whose image + instruction encoder is a Hugging Face VLM loaded from a local directory:
tiny random PaliGemma, Qwen2.5-VL and SmolVLM2 models (built and saved here, no hub) pass the policy
contract with every head; prompt padding does not change a sample's actions; the VLM can be
fine-tuned."""

import pytest
import torch
from test_vla import HEADS, SPEC, tiny
from tiny_vlms import FAMILIES, not_a_vlm, qwen2_5_vl, smolvlm

from embodied.contract import check_policy, random_observation
from embodied.models import build_policy

SPEC32 = SPEC.__class__(
    **{
        **SPEC.__dict__,
        "obs": SPEC.obs.__class__(
            **{
                **SPEC.obs.__dict__,
                "cameras": tuple(c.__class__(c.name, 32, 32) for c in SPEC.obs.cameras),
            }
        ),
    }
)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm_dir(request, tmp_path_factory):
    return str(FAMILIES[request.param](tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("head", HEADS)
def test_check_policy_with_a_local_vlm(vlm_dir, head):
    torch.manual_seed(0)
    policy = build_policy(SPEC32, tiny(head, vlm_path=vlm_dir))
    assert policy.vlm is not None and not hasattr(policy, "vision")
    report = check_policy(
        policy, SPEC32, batch_size=3
    )  # includes evaluate() == act() log-prob to 1e-5
    assert report["chunk"] == 3


def test_padding_does_not_change_a_samples_actions(vlm_dir):
    torch.manual_seed(0)
    policy = build_policy(SPEC32, tiny("gaussian", vlm_path=vlm_dir)).eval()
    obs = random_observation(SPEC32, 2, torch.device("cpu"))
    obs.instruction = [
        "push the cube",
        "pull the cube back to the red and white target",
    ]  # different lengths
    both = policy.act(obs, deterministic=True).actions
    alone = policy.act(obs.index(torch.tensor([0])), deterministic=True).actions
    torch.testing.assert_close(both[:1], alone, atol=1e-5, rtol=1e-5)


def test_vlm_is_frozen_or_fine_tuned(vlm_dir):
    torch.manual_seed(0)
    obs = random_observation(SPEC32, 4, torch.device("cpu"))
    target = torch.zeros(4, 3, SPEC32.action.dim)
    for freeze in (True, False):
        policy = build_policy(SPEC32, tiny("gaussian", vlm_path=vlm_dir, freeze_vlm=freeze))
        loss, _ = policy.bc_loss(obs, target)
        loss.backward()
        grads = [p.grad for p in policy.vlm.parameters()]
        if freeze:
            assert all(g is None for g in grads)
        else:
            assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


def test_a_moved_vlm_directory_is_a_one_line_error_naming_the_key(tmp_path):
    """A checkpoint's policy.vlm_path that is gone (`embodied eval` rebuilds the VLM from it,
    after the config was checked where it was trained): a UserError naming the key and the
    path, which the CLI prints as one line, not a FileNotFoundError traceback."""
    from embodied.models.vla.hf_vlm import HFVisionLanguage
    from embodied.schema import UserError

    with pytest.raises(UserError, match=rf"^policy.vlm_path: {tmp_path}/gone is not a model dir"):
        HFVisionLanguage(tmp_path / "gone")


def test_a_directory_transformers_cannot_load_as_a_vlm_is_a_one_line_error(tmp_path):
    """A directory with a config.json that is another kind of model, or has no weights: a
    VLMNotFound (a UserError) naming the key, the path and transformers' first line, not
    transformers' ValueError or OSError traceback."""
    from embodied.models.vla.hf_vlm import HFVisionLanguage, VLMNotFound

    cases = {
        not_a_vlm(tmp_path / "bert"): "Unrecognized configuration class <class 'transformers",
        smolvlm(tmp_path / "bare", weights=False): "Error no file named model.safetensors",
    }
    for path, cause in cases.items():
        with pytest.raises(VLMNotFound) as error:
            HFVisionLanguage(path)
        head = f"policy.vlm_path: {path} cannot be loaded as a vision-language model: "
        assert str(error.value).startswith(head + cause) and "\n" not in str(error.value)


def test_a_directory_whose_weights_do_not_fit_its_config_is_a_one_line_error(tmp_path):
    """A layer's weights missing (transformers started them at random: a frozen VLM kept them
    so), or all of them another size (its RuntimeError traceback): one line naming it."""
    import json

    from safetensors.torch import load_file, save_file

    from embodied.models.vla.hf_vlm import HFVisionLanguage, VLMNotFound

    path = smolvlm(tmp_path / "partial")
    weights = load_file(path / "model.safetensors")
    gone = sorted(k for k in weights if ".layers.0." in k and "q_proj" in k)
    save_file({k: v for k, v in weights.items() if k not in gone}, path / "model.safetensors")
    with pytest.raises(VLMNotFound) as error:
        HFVisionLanguage(path)
    said = f"policy.vlm_path: {path}'s weights do not fit its config.json: {len(gone)} missing"
    assert str(error.value).startswith(said) and "\n" not in str(error.value)
    path = smolvlm(tmp_path / "wider")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["intermediate_size"] *= 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VLMNotFound, match=f"^policy.vlm_path: {path} cannot be loaded"):
        HFVisionLanguage(path)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_5_vl"])
def test_each_camera_is_one_whole_image_with_or_without_the_full_processor(tmp_path, family):
    """SmolVLM2's files tile a large image into crops, each with its own tokens: each camera is
    one whole image instead (2 x (4 image + 3 mark) + 3 text = 17 tokens here, not 81 with 2x2
    tiles). The processor an install without torchvision falls back on gives the same token ids
    and pixels as the family's own, marks included."""
    import numpy as np

    from embodied.models.vla.hf_vlm import HFVisionLanguage, ImagesOnlyProcessor

    if family == "smolvlm":
        path = smolvlm(tmp_path / family, tiles=True)
    else:
        path = qwen2_5_vl(tmp_path / family)
    vlm = HFVisionLanguage(path)
    images = np.random.default_rng(0).integers(0, 256, (2, 2, 64, 48, 3), dtype=np.uint8)
    hidden, mask = vlm(list(torch.from_numpy(images).unbind(1)), ["push the cube", "pick the cube"])
    if family == "smolvlm":
        assert mask.shape == (2, 17)
    text = [vlm.image_prompt * 2 + words for words in ("push the cube", "pick the red cube")]
    per_sample = [list(cameras) for cameras in images]
    full = vlm.processor(
        text=text, images=per_sample, return_tensors="pt", padding=True, **vlm.image_options
    )
    alone = ImagesOnlyProcessor(path)(text=text, images=per_sample)
    for key in ("input_ids", "attention_mask", "pixel_values"):  # (images batched or flat)
        assert torch.equal(full[key].flatten(), alone[key].flatten()), key
