"""Who may speak as a rank: the proofs a daemon asks of its peers.

``secret`` mode: every daemon holds the cluster secret (``security.secret_file``); it never
travels. A peer's gRPC handshake is a challenge-response both ways: the caller sends a nonce
(``Challenge``), the callee answers with its own nonce and an HMAC-SHA256 over both nonces and
the ranks (so the caller knows it reached a daemon that holds the secret), and the caller's
``Handshake`` carries its own HMAC over the same (so the callee knows the caller does). Both
ends then derive a one-time session key from the secret and the nonces. ``mtls`` mode: TLS
proves the caller's certificate and the callee hands it a fresh random session key over that
channel. Either way, the caller's bulk connection opens with a HELLO that carries an HMAC under
that session key; the key is consumed by the first HELLO it admits, so a replayed HELLO or one
from anyone without the key never reaches the tensor path. ``insecure`` mode proves nothing.

The MACs come from :mod:`hmac` and :mod:`hashlib`; nothing here is hand-made cryptography.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from decent_wire.v1 import decent_pb2 as pb

if TYPE_CHECKING:
    from decentd.security.tls import Tls

Mode = Literal["insecure", "secret", "mtls"]

NONCE_BYTES = 32
#: the shortest secret accepted (bytes of the file, surrounding whitespace stripped)
MIN_SECRET_BYTES = 16
#: a challenge is answered within this many seconds, or it is forgotten
CHALLENGE_TTL = 30.0
#: challenges remembered at once (the oldest is dropped first: a flood cannot grow memory)
MAX_CHALLENGES = 1024


def mac(key: bytes, label: str, *fields: bytes | str | int) -> bytes:
    """HMAC-SHA256 under ``key`` of ``label`` and ``fields``, each length-prefixed (so no
    two field lists give the same input)."""
    h = hmac.new(key, label.encode(), hashlib.sha256)
    for f in fields:
        data = f if isinstance(f, bytes) else str(f).encode()
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.digest()


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def read_secret(path: str) -> bytes:
    """The cluster secret in ``path``; ValueError says what is wrong with the file."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the secret file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"the secret file {path} is readable by others (mode "
                         f"{mode & 0o777:o}); chmod 600 it")
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret in {path} is {len(data)} bytes; at least "
                         f"{MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32`)")
    return data


def write_secret(path: Path) -> Path:
    """A fresh random secret in a new file only its owner can read (``decentrun``)."""
    fd = path.open("x")  # fails if it exists: never reuse another run's secret
    with fd:
        path.chmod(0o600)
        fd.write(secrets.token_hex(32))
    return path


@dataclass
class Challenge:
    """A nonce this daemon handed out, waiting for the handshake that answers it."""

    from_rank: int
    client_nonce: bytes
    expires: float


class PeerAuth:
    """This daemon's side of the proofs: issuing and checking them, as callee and caller."""

    def __init__(self, mode: Mode, cluster_id: str, secret: bytes | None = None,
                 tls: Tls | None = None) -> None:
        if mode == "secret" and not secret:
            raise ValueError("secret mode needs a secret")
        if (mode == "mtls") != (tls is not None):
            raise ValueError("mtls mode needs TLS material, and only it")
        self.mode = mode
        #: mtls: the certificates and contexts (:mod:`decentd.security.tls`)
        self.tls = tls
        self.cluster_id = cluster_id
        self._secret = secret or b""
        self._challenges: collections.OrderedDict[bytes, Challenge] = collections.OrderedDict()
        #: by peer rank: the session key its next bulk HELLOs must prove (one per connection
        #: of its link), and the connections that proved it already
        self._bulk_keys: dict[int, bytes] = {}
        self._hellos: dict[int, set[int]] = {}

    @property
    def proves(self) -> bool:
        """Whether peers must prove who they are."""
        return self.mode != "insecure"

    # ------------------------------------------------------------------ callee (secret mode)

    def challenge(self, from_rank: int, to_rank: int, client_nonce: bytes) -> tuple[bytes, bytes]:
        """A caller's challenge: (our nonce, our proof that we hold the secret)."""
        if len(client_nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce of {len(client_nonce)} bytes, not {NONCE_BYTES}")
        now = time.monotonic()
        while self._challenges and (len(self._challenges) >= MAX_CHALLENGES or
                                    next(iter(self._challenges.values())).expires < now):
            self._challenges.popitem(last=False)
        server_nonce = new_nonce()
        self._challenges[server_nonce] = Challenge(from_rank, client_nonce, now + CHALLENGE_TTL)
        return server_nonce, self._proof("server", from_rank, to_rank, client_nonce,
                                         server_nonce)

    def admit_handshake(self, from_rank: int, to_rank: int, server_nonce: bytes,
                        proof: bytes) -> str | None:
        """Check a caller's proof (secret mode); None when admitted (its bulk key is then
        expected), else why not. A challenge answers one handshake only."""
        pending = self._answered(from_rank, to_rank, server_nonce, proof, "client")
        if isinstance(pending, str):
            return pending
        self._bulk_keys[from_rank] = self._proof("session", from_rank, to_rank,
                                                 pending.client_nonce, server_nonce)
        self._hellos[from_rank] = set()
        return None

    def admit_status(self, from_rank: int, to_rank: int, server_nonce: bytes,
                     proof: bytes) -> str | None:
        """Check a peer's status request (secret mode): None when it answers a challenge of
        ours with the secret, else why not."""
        pending = self._answered(from_rank, to_rank, server_nonce, proof, "status")
        return pending if isinstance(pending, str) else None

    def _answered(self, from_rank: int, to_rank: int, server_nonce: bytes, proof: bytes,
                  label: str) -> Challenge | str:
        """The challenge ``proof`` answers (consumed), or why it answers none."""
        pending = self._challenges.pop(server_nonce, None)
        if pending is None or pending.expires < time.monotonic():
            return "the request answers no challenge of ours (expired or replayed)"
        if pending.from_rank != from_rank:
            return f"the challenge was issued to rank {pending.from_rank}"
        want = self._proof(label, from_rank, to_rank, pending.client_nonce, server_nonce)
        if not hmac.compare_digest(want, proof):
            return "wrong proof: it does not hold this cluster's secret"
        return pending

    def issue_bulk_key(self, from_rank: int) -> bytes:
        """A fresh session key for an authenticated caller (mtls: sent over TLS)."""
        key = secrets.token_bytes(32)
        self._bulk_keys[from_rank] = key
        self._hellos[from_rank] = set()
        return key

    def admit_hello(self, from_rank: int, to_rank: int, hello: pb.BulkHeader) -> bool:
        """Whether a bulk HELLO from ``from_rank`` proves the key of its handshake, for its
        connection of the link (each connection once; the key is consumed when all of them
        proved it); always True in insecure mode."""
        if not self.proves:
            return True
        key = self._bulk_keys.get(from_rank)
        stripe, used = int(hello.stripe), self._hellos.get(from_rank, set())
        if key is None or stripe in used or not hmac.compare_digest(
                self.hello_proof(key, from_rank, to_rank, hello), bytes(hello.proof)):
            return False
        used.add(stripe)
        if len(used) >= max(1, int(hello.stripes)):
            del self._bulk_keys[from_rank]
            self._hellos.pop(from_rank, None)
        return True

    # ------------------------------------------------------------------ caller

    def server_proof_ok(self, from_rank: int, to_rank: int, client_nonce: bytes,
                        server_nonce: bytes, proof: bytes) -> bool:
        """Whether the callee's challenge reply proves it holds the secret."""
        want = self._proof("server", from_rank, to_rank, client_nonce, server_nonce)
        return hmac.compare_digest(want, proof)

    def client_proof(self, from_rank: int, to_rank: int, client_nonce: bytes,
                     server_nonce: bytes) -> tuple[bytes, bytes]:
        """(our handshake proof, the session key both ends derive) for a challenge reply."""
        args = (from_rank, to_rank, client_nonce, server_nonce)
        return self._proof("client", *args), self._proof("session", *args)

    def status_proof(self, from_rank: int, to_rank: int, client_nonce: bytes,
                     server_nonce: bytes) -> bytes:
        """Our proof for a status request that answers a challenge."""
        return self._proof("status", from_rank, to_rank, client_nonce, server_nonce)

    def hello_proof(self, key: bytes, from_rank: int, to_rank: int,
                    hello: pb.BulkHeader) -> bytes:
        """The proof a bulk ``hello`` carries for one connection of a link (empty in insecure
        mode)."""
        return mac(key, "hello", self.cluster_id, from_rank, to_rank, int(hello.bundle),
                   int(hello.stripe), int(hello.stripes)) if key else b""

    def _proof(self, label: str, from_rank: int, to_rank: int, client_nonce: bytes,
               server_nonce: bytes) -> bytes:
        return mac(self._secret, label, self.cluster_id, from_rank, to_rank, client_nonce,
                   server_nonce)


def shown(text: str, limit: int = 64) -> str:
    """Peer-supplied text as it may appear in a log: escaped, at most ``limit`` characters."""
    out = repr(text[:limit])
    return out + ("..." if len(text) > limit else "")
