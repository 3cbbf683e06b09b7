"""A small server to run inside a sandbox for the port proxy's tests and benchmark.

Standard library only (the sandbox's /usr/bin/python3 has no `websockets`): files, an echo,
the request's own headers, a redirect, a server-sent events stream and a WebSocket echo
written by hand (RFC 6455: the handshake, unfragmented frames, close).

    python3 server.py PORT      # serves its working directory (the sandbox's /workspace)
"""

from __future__ import annotations

import time

import httpx

SERVER = r"""
import base64, hashlib, http.server, json, socketserver, struct, sys, time

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, body, kind="text/plain", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_POST(self):
        data = self.body()
        if self.path.startswith("/echo"):
            self.answer(200, data, self.headers.get("Content-Type", "application/octet-stream"))
        else:
            self.answer(404, b"no such thing")

    do_PUT = do_POST

    def do_GET(self):
        if self.path.startswith("/headers"):
            seen = {"path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()]}
            self.answer(200, json.dumps(seen).encode(), "application/json")
        elif self.path.startswith("/redirect"):
            self.answer(302, b"", extra=[("Location", "/hello.txt"),
                                          ("Set-Cookie", "app=1; Path=/")])
        elif self.path.startswith("/sse"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for n in range(3):
                self.wfile.write(b"data: %d %f\n\n" % (n, time.time()))
                self.wfile.flush()
                time.sleep(0.6)
            self.close_connection = True
        elif self.path.startswith("/ws"):
            self.websocket()
        else:
            super().do_GET()

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"].encode()
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        offered = self.headers.get("Sec-WebSocket-Protocol")
        if offered:
            self.send_header("Sec-WebSocket-Protocol", offered.split(",")[0].strip())
        self.end_headers()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = struct.unpack(">H", self.rfile.read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 8:
                self.frame(8, data[:2] or struct.pack(">H", 1000))
                return
            if opcode in (1, 2):
                self.frame(opcode, data)

    def frame(self, opcode, data):
        n = len(data)
        if n < 126:
            size = bytes([n])
        elif n < 65536:
            size = b"\x7e" + struct.pack(">H", n)
        else:
            size = b"\x7f" + struct.pack(">Q", n)
        self.wfile.write(bytes([0x80 | opcode]) + size + data)
        self.wfile.flush()


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def ports(name: str, port: int) -> str:
    return f"/api/v1/sandboxes/{name}/ports/{port}"


def start(client: httpx.Client, sandbox: str, port: int) -> int:
    """Put the server in the sandbox's workspace (with a hello.txt beside it), start it on
    `port`, wait until it answers through the proxy; its pid."""
    files = f"/api/v1/sandboxes/{sandbox}/toolbox/files"
    for path, data in (("server.py", SERVER.encode()), ("hello.txt", b"hello\n")):
        put = client.put(files, params={"path": path}, content=data)
        assert put.status_code == 200, put.text
    started = client.post(
        f"/api/v1/sandboxes/{sandbox}/toolbox/processes",
        json={"command": f"exec python3 server.py {port}"},
    )
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while True:
        answer = client.get(f"{ports(sandbox, port)}/hello.txt")
        if answer.status_code == 200:
            return int(started.json()["pid"])
        assert answer.status_code == 502, answer.text
        assert time.monotonic() < deadline, f"the server never answered: {answer.text}"
        time.sleep(0.1)
