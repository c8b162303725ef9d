"""A local stand-in for the Hugging Face Hub: the four endpoints snapshot_download uses, serving one folder."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from contextlib import contextmanager
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@contextmanager
def serve_repo(folder: Path, repo_id: str = "org/model", revisions=("main",)):
    """Yield (endpoint, log): the endpoint URL and the list of (method, path, authorization) requests."""
    files = sorted(p.name for p in folder.iterdir())
    log = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, body=b"", headers=()):
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            log.append((self.command, self.path, self.headers.get("Authorization")))
            api = f"/api/models/{repo_id}"
            if self.path.startswith(f"{api}/revision/"):
                if self.path.split("/revision/")[1].split("?")[0] not in revisions + (COMMIT,):
                    return self._send(404, headers=[("X-Error-Code", "RevisionNotFound")])
                info = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
                return self._send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
            if self.path.startswith(f"{api}/tree/"):
                tree = [{"type": "file", "path": f, "size": (folder / f).stat().st_size,
                         "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest()} for f in files]
                return self._send(200, json.dumps(tree).encode(), [("Content-Type", "application/json")])
            prefix = f"/{repo_id}/resolve/"
            if self.path.startswith(prefix):
                name = self.path[len(prefix):].split("/", 1)[1]
                if name in files:
                    data = (folder / name).read_bytes()
                    return self._send(200, data, [("ETag", f'"{hashlib.sha256(data).hexdigest()}"'),
                                                  ("X-Repo-Commit", COMMIT)])
            if self.path.startswith("/api/models/"):
                return self._send(404, headers=[("X-Error-Code", "RepoNotFound")])
            return self._send(404)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
