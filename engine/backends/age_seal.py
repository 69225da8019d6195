"""age encryption of exported checkpoint files (Tinker's ``age_encryption_recipients``).

Owns turning recipient strings into pyrage recipients (native X25519 ``age1...`` keys or SSH
``ssh-ed25519`` / ``ssh-rsa`` public keys, at most `MAX_RECIPIENTS`; a bad one is a
UserInputError naming ``age_encryption_recipients[i]``) and the `Sealer` the checkpoint writers
call on each file's bytes before anything reaches the disk: an encrypted export never holds a
plaintext byte, and its files carry `AGE_SUFFIX` (the SDK's convention: ``age -d -i <identity>``
decrypts them). pyrage binds the Rust ``rage`` implementation of the age format (age-encryption.org
v1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyrage

from engine.errors import UserInputError

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # the SDK's documented limit
FIELD = "age_encryption_recipients"

#: a file's bytes → what is written, and the name it is written under
Sealer = Callable[[str, bytes], tuple[str, bytes]]


def parse_recipients(keys: Sequence[str]) -> list:
    """pyrage recipients of ``keys`` (UserInputError naming the first bad one)."""
    if not keys or len(keys) > MAX_RECIPIENTS:
        raise UserInputError(f"{FIELD}: give 1 to {MAX_RECIPIENTS} recipients, got {len(keys)}")
    out = []
    for i, key in enumerate(keys):
        kind = pyrage.ssh if isinstance(key, str) and key.startswith("ssh-") else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(key.strip()))
        except (pyrage.RecipientError, AttributeError, TypeError, ValueError) as e:
            raise UserInputError(
                f"{FIELD}[{i}]: not an age recipient (an 'age1...' X25519 key or an "
                f"'ssh-ed25519' / 'ssh-rsa' public key): {e}"
            ) from None
    return out


def age_sealer(keys: Sequence[str]) -> Sealer | None:
    """The `Sealer` that encrypts to ``keys``; None for no keys (plain files, names unchanged)."""
    if not keys:
        return None
    recipients = parse_recipients(keys)

    def seal(name: str, data: bytes) -> tuple[str, bytes]:
        return name + AGE_SUFFIX, pyrage.encrypt(data, recipients)

    return seal


def export_sealer(keys: Sequence[str]) -> Sealer:
    """How a checkpoint's files are written: encrypted to ``keys``, or `plain` without any."""
    return age_sealer(keys) or plain


def plain(name: str, data: bytes) -> tuple[str, bytes]:
    """The identity `Sealer`: the file as it is."""
    return name, data
