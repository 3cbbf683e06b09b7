"""The Connect codecs of envd: connectrpc's own (Protocol Buffers JSON and binary), refusing
a message that does not decode with `invalid_argument` instead of failing the request."""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError


class RefusingMalformed(Codec[Any, Any]):
    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:  # the decoders' errors vary (JSON, types, wire format)
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"malformed {self.name()} request message: {exc}"
            ) from None


def envd_codecs() -> list[Codec[Any, Any]]:
    return [RefusingMalformed(proto_binary_codec()), RefusingMalformed(proto_json_codec())]
