"""age-encrypted exports through the unmodified tinker 0.38.0 SDK against `twinkle serve`:
``save_weights_external(name, age_encryption_recipients=[...])`` stores only ciphertext
(``<file>.age``), its signed URLs serve that ciphertext, and each recipient's identity decrypts it
to exactly the files of a plain export of the same weights, which load in peft and give the
server's log-probs. Bad recipients fail the save naming the field; the model goes on."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import tinker
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
_rng = np.random.default_rng(23)
SEQS = [_rng.integers(10, 500, size=9).tolist() for _ in range(2)]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(s[:-1]),
        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
    )
    for s in SEQS
]
FILES = ("adapter_model.safetensors", "adapter_config.json")


def _ssh_identity() -> tuple[str, object]:
    """An OpenSSH ed25519 key pair made here: (public key line, pyrage identity)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return public.decode(), pyrage.ssh.Identity.from_buffer(private)


def _download(rest, path: str) -> dict[str, bytes]:
    urls = rest.get_external_weights_urls(path).result().urls
    out = {}
    for name, url in urls.items():
        r = httpx.get(url, timeout=30)  # no API key: the signature is the credential
        assert r.status_code == 200, r.text
        out[name] = r.content
    return out


@pytest.fixture(scope="module")
def owner(server):
    key = server.create_key("age-owner")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    yield sc, tinker.RestClient(base_url=server.url, api_key=key)
    sc.close("success")


def test_encrypted_export_is_ciphertext_that_decrypts_to_a_peft_adapter(server, owner, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    sc, rest = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=8).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    server_out = tc.forward(DATA, "cross_entropy").result()
    age_identity = pyrage.x25519.Identity.generate()
    ssh_public, ssh_identity = _ssh_identity()
    recipients = [str(age_identity.to_public()), ssh_public]
    plain_path = tc.save_weights_external("plain").result().path
    sealed_path = tc.save_weights_external("sealed", age_encryption_recipients=recipients)
    sealed_path = sealed_path.result().path
    assert sealed_path.endswith("/external_weights/sealed")

    plain, sealed = _download(rest, plain_path), _download(rest, sealed_path)
    assert set(plain) == set(FILES)
    assert set(sealed) == {f + ".age" for f in FILES}  # the SDK's name for encrypted files
    for name in FILES:
        assert sealed[name + ".age"].startswith(b"age-encryption.org/v1\n")
        for identity in (age_identity, ssh_identity):
            assert pyrage.decrypt(sealed[name + ".age"], [identity]) == plain[name]
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(sealed[FILES[1] + ".age"], [pyrage.x25519.Identity.generate()])

    # The export store holds ciphertext only: every file of the export's directory is .age but
    # the manifest (names, sizes and hashes of the ciphertext), and no plaintext byte pattern.
    dirs = [p for p in Path(server.data_dir).rglob("sealed*") if p.is_dir()]
    assert len(dirs) == 1 and "external_weights" in str(dirs[0])
    stored = {p.name: p.read_bytes() for p in dirs[0].iterdir()}
    assert set(stored) == {f + ".age" for f in FILES} | {"twinkle_state.json.age", "manifest.json"}
    for name, data in stored.items():
        if name != "manifest.json":
            assert b"lora_A" not in data and b"peft_type" not in data and b'"step"' not in data

    out = tmp_path / "decrypted"
    out.mkdir()
    for name in FILES:
        (out / name).write_bytes(pyrage.decrypt(sealed[name + ".age"], [age_identity]))
    base = AutoModelForCausalLM.from_pretrained(Path(server.data_dir) / "models" / "tiny-chat")
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    for datum, outputs in zip(DATA, server_out.loss_fn_outputs, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        np.testing.assert_allclose(lp.numpy(), outputs["logprobs"].tolist(), atol=1e-5)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[sealed_path].checkpoint_type == "external"
    rest.delete_checkpoint_from_tinker_path(sealed_path).result()
    assert not dirs[0].exists()


@pytest.mark.parametrize(
    ("recipients", "needle"),
    [
        (["age1xyz"], r"age_encryption_recipients\[0\]"),
        (
            [str(pyrage.x25519.Identity.generate().to_public()), "ssh-ed25519 AAAAbad"],
            r"age_encryption_recipients\[1\]",
        ),
        ([], "1 to 10"),
        ([str(pyrage.x25519.Identity.generate().to_public())] * 11, "1 to 10"),
    ],
)
def test_bad_recipients_fail_the_save_naming_the_field(owner, recipients, needle):
    sc, rest = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    with pytest.raises(tinker.RequestFailedError, match=needle) as e:
        tc.save_weights_external("bad", age_encryption_recipients=recipients).result()
    assert e.value.category == "user"
    # nothing was written, and the model's next request runs
    assert tc.save_weights_external("after").result().path.endswith("/after")
    paths = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert not any(p.endswith("/bad") for p in paths)
