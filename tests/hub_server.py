"""A local stand-in for the Hugging Face Hub, for the tests: the part of the protocol that
huggingface_hub (>= 0.2x; read against 2.4's file_download.py and _snapshot_download.py) uses
through `HF_ENDPOINT` to download a model repository.

- `GET /api/models/{repo}[/revision/{rev}]`: the model info (`id`, `sha`, `siblings`, `gated`);
- `GET /api/models/{repo}/tree/{rev}`: the file listing (`type`, `path`, `size`, `oid`, `lfs`);
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}`: the file, with `ETag`, `X-Repo-Commit`,
  `Content-Length`, `Accept-Ranges` and `Range` requests answered `206`.

Errors carry the Hub's `X-Error-Code` (`RepoNotFound` 404, `GatedRepo` 401 on the files of a
gated repository, `EntryNotFound` 404). Faults, for the tests: `drop_once` names files whose
first GET is cut off halfway (the connection closed), `silent` makes every request wait
unanswered until the server stops. `requests` logs (method, path, Range header).
`/api/agent-harnesses` (huggingface_hub's telemetry registry) is answered empty, even when
`silent`: its 3 s timeout would only slow the tests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS = (".safetensors", ".gguf", ".bin")       # stored by git-lfs on the Hub: an `lfs` entry


class Repo:
    """A repository served from a local folder: its files, one commit."""

    def __init__(self, folder: Path, gated: bool = False):
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes()
                      for p in sorted(folder.rglob("*")) if p.is_file()}
        self.gated = gated
        digest = hashlib.sha1()
        for name, data in self.files.items():
            digest.update(name.encode() + hashlib.sha256(data).digest())
        self.sha = digest.hexdigest()

    def etag(self, name: str) -> str:
        data = self.files[name]
        if name.endswith(LFS):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()   # git's blob id

    def tree(self) -> list[dict]:
        out = []
        for name, data in self.files.items():
            entry = {"type": "file", "path": name, "size": len(data),
                     "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if name.endswith(LFS):
                entry["lfs"] = {"oid": self.etag(name), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


class HubServer:
    """`with HubServer({"org/name": folder, ...}, gated={"org/locked"}) as hub:` then
    `HF_ENDPOINT=hub.url`."""

    def __init__(self, repos: dict[str, Path], gated: set[str] = frozenset()):
        self.repos = {rid: Repo(Path(folder), gated=rid in gated) for rid, folder in repos.items()}
        self.drop_once: set[str] = set()
        self.silent = False
        self.requests: list[tuple[str, str, str | None]] = []
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def fetched(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of files called `name`, in order."""
        return [rng for method, path, rng in self.requests
                if method == "GET" and "/resolve/" in path and path.endswith("/" + name)]


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):          # quiet: the tests read `hub.requests`
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            if path == "/api/agent-harnesses":  # huggingface_hub's telemetry: none
                return self._json({"standardEnvVars": [], "harnesses": {}})
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if hub.silent:                      # a Hub that stopped answering
                hub._stopping.wait()
                return
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound", "Repository not found")

        def _api(self, repo_id: str, rest: list[str]) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if rest[:1] == ["tree"]:
                return self._json(repo.tree())
            self._json({"id": repo_id, "sha": repo.sha, "private": False,
                        "gated": "manual" if repo.gated else False,
                        "siblings": [{"rfilename": name} for name in repo.files]})

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if repo.gated:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. "
                                   "You must have access to it and be authenticated to access "
                                   "it. Please log in.")
            if revision not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            if name not in repo.files:
                return self._error(404, "EntryNotFound", f"{name} does not exist", repo.sha)
            data = repo.files[name]
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and body:
                start = int(rng[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in hub.drop_once and not start:
                hub.drop_once.discard(name)
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)     # cut off: the client sees a short body
                return
            self.wfile.write(data[start:])

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, commit: str | None = None):
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

    return Handler
