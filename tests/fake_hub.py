"""A local stand-in for huggingface.co's HTTP API: the few routes huggingface_hub's snapshot_download takes (a
repository's revision, its file tree, each file's HEAD and GET), and the error headers the hub answers with, so that
a test can run specdec against it as a user runs it against the hub, with HF_ENDPOINT pointing here.

It serves folders as repositories at one commit each. What it does not do (xet storage, LFS pointers, pagination
past one page, tokens) huggingface_hub does not need for plain files."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = {
    "info": re.compile(rf"^/api/models/{REPO}/revision/(?P<revision>[^/]+)$"),
    "tree": re.compile(rf"^/api/models/{REPO}/tree/(?P<revision>[^/]+)$"),
    "file": re.compile(rf"^/{REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)$"),
}


@dataclass
class Repository:
    files: dict[str, bytes]
    commit: str
    gated: bool = False


@dataclass
class FakeHub:
    repositories: dict[str, Repository] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) in the order they came

    def add(self, repo_id: str, folder: Path, gated: bool = False) -> str:
        """Serve `folder`'s files as `repo_id` at one commit (returned), reachable as "main" too."""
        files = {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}
        commit = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repositories[repo_id] = Repository(files, commit, gated)
        return commit

    def fetched(self, suffix: str) -> list[str]:
        """The paths of the file GETs whose name ends in `suffix`."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path
                and path.endswith(suffix)]

    def serve(self) -> tuple[str, callable]:
        """Start serving on a free local port: (the endpoint, a function that stops it)."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's names)
                hub._answer(self, body=True)

            def do_HEAD(self):  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, *args):  # quiet
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()

        def stop():
            server.shutdown()
            server.server_close()

        return f"http://127.0.0.1:{server.server_address[1]}", stop

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append((request.command, path))
        for route, pattern in ROUTES.items():
            found = pattern.match(path)
            if found:
                break
        else:
            return _send(request, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        repository = self.repositories.get(found["repo"])
        if repository is None:  # the hub's answer for a repository that does not exist or is private
            return _send(request, 401, b"", {"X-Error-Code": "RepoNotFound",
                                             "X-Error-Message": "Repository not found"}, body)
        if repository.gated:
            return _send(request, 403, b"", {"X-Error-Code": "GatedRepo",
                                             "X-Error-Message": "Access to this model is restricted"}, body)
        if found["revision"] not in ("main", repository.commit):
            return _send(request, 404, b"", {"X-Error-Code": "RevisionNotFound",
                                             "X-Error-Message": "Invalid rev id"}, body)
        if route == "info":
            info = {"id": found["repo"], "sha": repository.commit, "private": False,
                    "siblings": [{"rfilename": name} for name in repository.files]}
            return _send(request, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if route == "tree":
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in repository.files.items()]
            return _send(request, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        data = repository.files.get(found["path"])
        if data is None:
            return _send(request, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        return _send(request, 200, data, {"X-Repo-Commit": repository.commit,
                                          "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                          "Content-Type": "application/octet-stream"}, body)


def _send(request: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool) -> None:
    request.send_response(status)
    for name, value in headers.items():
        request.send_header(name, value)
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    if body:
        request.wfile.write(data)
