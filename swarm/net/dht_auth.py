"""DHT requests and responses signed with the swarm key: a node without it can neither read nor write.

    dht = hivemind.DHT(..., authorizer=SwarmKeyAuthorizer(key))   # what start_dht(swarm_key=key) does

hivemind wraps every DHT RPC (ping, store, find) in its authorizer: a request is signed by the caller and
checked by the servicer before it is served; a response is signed by the servicer and checked by the caller
before it is used. Here the signature is an HMAC with the swarm key over the whole message, with a time and
a nonce against replays (a request older than ``MAX_SKEW_S`` or seen before is refused), and a response must
answer our request's nonce. A node without the key gets no answer; its answers are ignored; its requests
are refused, so it never enters an honest node's routing table.
"""

from __future__ import annotations

import hmac
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.net.swarm_key import SwarmKey

MAX_SKEW_S = 60.0


class SwarmKeyAuthorizer(AuthorizerBase):
    """See the module docstring."""

    def __init__(self, key: SwarmKey) -> None:
        self.key = key
        self._nonces: TimedStorage | None = None  # made in the DHT's process, where it is used

    def _sign(self, purpose: bytes, message) -> bytes:
        assert message.auth.signature == b""
        return self.key.mac(purpose, message.SerializeToString())

    def _signed(self, purpose: bytes, message) -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self.key.mac(purpose, message.SerializeToString()))
        finally:
            message.auth.signature = signature

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key=None) -> None:
        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(16)
        request.auth.signature = self._sign(b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        if not self._signed(b"request", request):
            return False
        now, nonce = get_dht_time(), request.auth.nonce
        if abs(request.auth.time - now) > MAX_SKEW_S or len(nonce) != 16:
            return False
        if self._nonces is None:
            self._nonces = TimedStorage()
        with self._nonces.freeze():
            if nonce in self._nonces:
                return False  # replayed
        self._nonces.store(nonce, None, now + 3 * MAX_SKEW_S)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = self._sign(b"response", response)

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        return response.auth.nonce == request.auth.nonce and self._signed(b"response", response)
