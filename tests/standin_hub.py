"""A loopback stand-in for the Hugging Face Hub, for tests (stdlib only).

The real, unpatched `huggingface_hub` (written against 2.4.0) talks plain HTTP to it::

    with StandinHub([HubRepo("org/tiny", {"config.json": b"{}", "model.safetensors": weights})]) as hub:
        with hub_online():                      # only needed in-process, see below
            path = snapshot_download("org/tiny", cache_dir=tmp, endpoint=hub.endpoint, token=False)

What it serves, shaped like huggingface.co (see `huggingface_hub/utils/_http.py::hf_raise_for_status`,
`file_download.py::get_hf_file_metadata`, `hf_api.py::model_info/list_repo_tree`):

* `GET /api/{models,datasets}/{repo_id}[/revision/{rev}]`: repo info (`sha`, `gated`, `siblings`;
  `?blobs=True` adds sizes/blob ids/LFS info).
* `GET /api/{models,datasets}/{repo_id}/tree/{rev}[/{path}]?recursive=..`: tree listing, paginated with a
  GitHub-style `Link: <...>; rel="next"` header (`hub.page_size`, default 1000 like the Hub).
* `HEAD|GET /[datasets/]{repo_id}/resolve/{rev}/{filename}`: the file. Always a direct 200 (no CDN redirect).
  Headers: `X-Repo-Commit`, `ETag` (quoted; git blob sha1 of the content for regular files, sha256 for LFS
  files), for LFS files also `X-Linked-Etag` and `X-Linked-Size`, `Content-Length`, `Accept-Ranges: bytes`.
  Never any `X-Xet-*` header or `xet-auth` link, so the library always takes the plain HTTP path.
  `Range: bytes=a-b | a- | -n` -> 206 + `Content-Range`; unsatisfiable -> 416 `Content-Range: bytes */size`.
* `GET /api/agent-harnesses`: an empty registry (huggingface_hub fetches it once per process from
  `HF_ENDPOINT` to build its User-Agent).
* Revisions: `main` and the 40-hex commit sha of every version ever added (`HubRepo.sha`, deterministic from the
  content). Errors carry the `X-Error-Code` / `X-Error-Message` headers the library classifies on:
  unknown repo -> 401 (anonymous) / 404 (with a token) `RepoNotFound`; unknown revision -> 404
  `RevisionNotFound`; unknown file -> 404 `EntryNotFound` (+ `X-Repo-Commit`); gated repo file without the
  right token -> 401 (anonymous) / 403 (wrong token) `GatedRepo`. As on the Hub, a gated repo's info and tree
  are public; only `/resolve` is gated.
* Files ending in .safetensors/.bin/.gguf are LFS files (tree entry has `lfs: {oid: sha256, size,
  pointerSize}`, `oid` = git sha1 of the LFS pointer); the others are git blobs.

Fault keys are `"<repo_id>/<filename>"`, e.g. `"org/tiny/model.safetensors"`.

What the library does (huggingface_hub 2.4.0, read from its source and pinned by tests/test_standin_hub.py):

* Exceptions (all in `huggingface_hub.errors`): gated -> `GatedRepoError` (a subclass of
  `RepositoryNotFoundError`!); unknown repo -> `RepositoryNotFoundError`; unknown revision ->
  `RevisionNotFoundError`; unknown file -> `RemoteEntryNotFoundError`; offline (hub unreachable,
  `HF_HUB_OFFLINE=1` or `local_files_only=True`) and nothing cached -> `LocalEntryNotFoundError`; offline and the
  snapshot folder exists but misses requested files -> `IncompleteSnapshotError` (a `LocalEntryNotFoundError`;
  only detectable because the first snapshot_download cached the tree listing, see below).
* Hub unreachable: `snapshot_download` falls back to the cache at once (its repo_info call has no retry), but
  `hf_hub_download` of a file that is NOT cached retries its HEAD with backoff (1+2+4+8+8 s) before raising
  `LocalEntryNotFoundError`: ~23 s. With `HF_HUB_OFFLINE=1` / `local_files_only=True` it is immediate.
* No sha256 check: downloads are verified by SIZE only (`http_get` compares bytes received with the size from
  HEAD). A same-size corrupted body lands in `blobs/<sha256>` and is then trusted forever.
* No cross-process resume: each download streams into a process-unique `blobs/<etag>.<8 hex>.incomplete`,
  deleted on any Python-level failure but left behind (orphaned, never reused, never cleaned) by SIGKILL; the
  next run downloads the whole file again without a `Range` header. `Range` is only used inside one call, when
  the connection breaks mid-body (httpx `RemoteProtocolError`/timeout): after a 1 s sleep it re-requests
  `bytes=<bytes already written>-`. Bytes are written in 10 MiB chunks (`DOWNLOAD_CHUNK_SIZE`), so an
  `.incomplete` file only ever holds multiples of 10 MiB (plus the tail), and a resume offset is one too.
* Second `snapshot_download` of a cached snapshot: one `GET /api/models/{id}/revision/main`, nothing else (tree
  listing cached in `<cache>/models--org--name/trees/<sha>.json`, files found via snapshot symlinks).

Configuration. `huggingface_hub.constants` reads these environment variables ONCE, at import time:
`HF_ENDPOINT`, `HF_HUB_OFFLINE` (and `TRANSFORMERS_OFFLINE`), `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN_PATH`,
`HF_HUB_DISABLE_XET`, `HF_HUB_DISABLE_TELEMETRY`, `HF_HUB_DISABLE_PROGRESS_BARS`, `HF_HUB_DISABLE_IMPLICIT_TOKEN`,
`HF_HUB_ETAG_TIMEOUT`, `HF_HUB_DOWNLOAD_TIMEOUT`. `HF_TOKEN` is read at call time.
tests/conftest.py does `os.environ.setdefault("HF_HUB_OFFLINE", "1")`, so:

* a subprocess must get `HF_HUB_OFFLINE=0` explicitly (it inherits the 1), plus `HF_ENDPOINT`, `HF_HOME`; use
  `hub.subprocess_env(hf_home)`;
* in the pytest process the library is (almost always) imported after conftest, hence offline: every request
  raises `OfflineModeIsEnabled`. `hub_online()` flips `huggingface_hub.constants.HF_HUB_OFFLINE` for a block.
  `HF_ENDPOINT` can't be changed in-process either: pass `endpoint=hub.endpoint` explicitly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_DATE = "2024-01-01T00:00:00.000Z"
_CHUNK = 64 * 1024


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob (what the Hub uses as ETag for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(filename: str) -> bool:
    return filename.endswith(LFS_SUFFIXES)


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


@dataclass
class HubRepo:
    """One version of a repo. `sha` (its commit) is a deterministic 40-hex function of the content."""

    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    repo_type: str = "model"

    @property
    def sha(self) -> str:
        h = hashlib.sha1(f"{self.repo_type}\0{self.repo_id}\0".encode())
        for name in sorted(self.files):
            h.update(f"{name}\0{git_blob_sha1(self.files[name])}\0".encode())
        return h.hexdigest()

    def etag(self, filename: str) -> str:
        """The ETag the Hub sends, i.e. the blob's name in the cache (`blobs/<etag>`)."""
        data = self.files[filename]
        return hashlib.sha256(data).hexdigest() if is_lfs(filename) else git_blob_sha1(data)


class LoggedRequest(NamedTuple):
    method: str
    path: str          # URL path, percent-decoded, without the query string
    range: str | None  # the Range header, if any


@dataclass
class _RepoState:
    main: str
    gated: bool
    commits: dict[str, HubRepo] = field(default_factory=dict)


@dataclass
class _Hold:
    left: int | None  # requests still to hold; None: every one until released
    released: bool = False


class _Abort(Exception):
    """Raised inside a handler to drop the connection without a proper response."""


class StandinHub:
    """Loopback HTTP stand-in for huggingface.co. Use as a context manager; `endpoint` is its base URL.

    Observation (thread-safe): `request_log`, `bytes_served[key]`, `wait_for_bytes`, `gets`.
    Faults: `throttle`, `stall`/`unstall`, `disconnect_at`, `corrupt` (a file's body); `hold`/`release`, `fail`
    (any request, by path: e.g. the tree listing); `close` (= the Hub goes offline).
    """

    token = "hf_standin_token_0123456789"  # the one token that opens gated repos

    def __init__(self, repos: list[HubRepo] = (), page_size: int = 1000):
        self.page_size = page_size
        self.request_log: list[LoggedRequest] = []
        self._log_keys: list[str | None] = []  # "<repo_id>/<filename>" of each /resolve request, else None
        self.bytes_served: dict[str, int] = defaultdict(int)
        self._repos: dict[tuple[str, str], _RepoState] = {}
        self._cond = threading.Condition()
        self._throttle: dict[str, float] = {}
        self._stall: dict[str, int] = {}
        self._disconnect: dict[str, list[int]] = {}  # key -> [offset, times left]
        self._corrupt: set[str] = set()
        self._held: dict[str, _Hold] = {}  # path prefix -> its hold
        self._failing: dict[str, list[int]] = {}  # path prefix -> [status, times left]
        self._closed = False
        for repo in repos:
            self.add(repo)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="standin-hub", daemon=True)
        self._thread.start()

    # ---- content -------------------------------------------------------------------------
    def add(self, repo: HubRepo) -> str:
        """Add a repo, or push a new version of it: `main` moves to it, older commits stay reachable by sha."""
        with self._cond:
            key = (repo.repo_type, repo.repo_id)
            state = self._repos.setdefault(key, _RepoState(main=repo.sha, gated=repo.gated))
            snapshot = HubRepo(repo.repo_id, dict(repo.files), repo.gated, repo.repo_type)
            state.commits[snapshot.sha] = snapshot
            state.main, state.gated = snapshot.sha, repo.gated
            return snapshot.sha

    # ---- observation ---------------------------------------------------------------------
    def gets(self, key: str | None = None) -> list[LoggedRequest]:
        """GETs of file bodies (`/resolve/`), optionally only those of `key` ("<repo_id>/<filename>")."""
        with self._cond:
            pairs = list(zip(self.request_log, self._log_keys))
        return [entry for entry, k in pairs if entry.method == "GET" and k and (key is None or k == key)]

    def wait_for_bytes(self, key: str, n: int, timeout: float = 10.0) -> None:
        """Block until at least `n` body bytes of `key` have been sent (in total); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.bytes_served[key] < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{key}: {self.bytes_served[key]} of {n} bytes served after {timeout}s")
                self._cond.wait(left)

    # ---- faults --------------------------------------------------------------------------
    def throttle(self, key: str, bytes_per_second: float | None) -> None:
        """Send `key`'s body at most this fast (None: full speed)."""
        with self._cond:
            if bytes_per_second is None:
                self._throttle.pop(key, None)
            else:
                self._throttle[key] = float(bytes_per_second)

    def stall(self, key: str, at: int) -> None:
        """Stop sending `key`'s body when reaching file offset `at` (connection stays open) until `unstall`."""
        with self._cond:
            self._stall[key] = at
            self._cond.notify_all()

    def unstall(self, key: str) -> None:
        with self._cond:
            self._stall.pop(key, None)
            self._cond.notify_all()

    def disconnect_at(self, key: str, offset: int, times: int = 1) -> None:
        """The next `times` responses for `key` that reach file offset `offset` are cut there (socket closed)."""
        with self._cond:
            self._disconnect[key] = [offset, times]

    def corrupt(self, key: str, enabled: bool = True) -> None:
        """Serve `key` with one byte flipped: same size and headers (ETag/X-Linked-Etag of the original)."""
        with self._cond:
            (self._corrupt.add if enabled else self._corrupt.discard)(key)

    def hold(self, prefix: str, times: int | None = None) -> None:
        """Requests whose URL path starts with `prefix` (e.g. "/api/models/": the tree listing) get no answer,
        the connection staying open, until `release` or `close`; with `times`, only the next `times` of them."""
        with self._cond:
            self._held[prefix] = _Hold(times)

    def release(self, prefix: str) -> None:
        """Answer the requests `hold` kept waiting, and the next ones."""
        with self._cond:
            hold = self._held.pop(prefix, None)
            if hold is not None:
                hold.released = True
            self._cond.notify_all()

    def fail(self, prefix: str, status: int, times: int = 1) -> None:
        """The next `times` requests whose URL path starts with `prefix` are answered `status` (e.g. 503)."""
        with self._cond:
            self._failing[prefix] = [status, times]

    def close(self) -> None:
        """Stop serving and cut every open connection: afterwards the endpoint refuses connections."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.cut_all()
        self._server.server_close()
        self._thread.join(5)

    # ---- configuration for a subprocess --------------------------------------------------
    def subprocess_env(self, hf_home: str | os.PathLike, *, token: str | None = None, offline: bool = False,
                       base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process whose (fresh) huggingface_hub import must use this hub.

        The cache is `<hf_home>/hub`. `token` becomes HF_TOKEN (None: no token at all).
        """
        env = dict(os.environ if base is None else base)
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH",
                    "TRANSFORMERS_OFFLINE", "HUGGINGFACE_CO_STAGING", "HF_XET_CACHE", "HF_ASSETS_CACHE"):
            env.pop(var, None)
        env.update(HF_ENDPOINT=self.endpoint, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1" if offline else "0",
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals used by the handler ---------------------------------------------------
    def _log(self, method: str, path: str, range_header: str | None, key: str | None) -> None:
        with self._cond:
            self.request_log.append(LoggedRequest(method, path, range_header))
            self._log_keys.append(key)

    def _wait_or_fail(self, path: str) -> int | None:
        """Before answering `path`: wait while a `hold` takes it; the status to `fail` it with, if any."""
        with self._cond:
            hold = next((hold for prefix, hold in self._held.items() if path.startswith(prefix)
                         and (hold.left is None or hold.left > 0)), None)
            if hold is not None:
                if hold.left is not None:
                    hold.left -= 1
                while not hold.released:
                    if self._closed:
                        raise _Abort()
                    self._cond.wait(0.5)
            failing = next((plan for prefix, plan in self._failing.items() if path.startswith(prefix) and plan[1] > 0),
                           None)
            if failing is not None:
                failing[1] -= 1
                return failing[0]
            return None

    def _lookup(self, repo_type: str, repo_id: str) -> _RepoState | None:
        with self._cond:
            return self._repos.get((repo_type, repo_id))

    def _body(self, key: str, data: bytes) -> bytes:
        with self._cond:
            corrupt = key in self._corrupt
        if corrupt and data:
            i = len(data) // 2
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
        return data

    def _next_chunk(self, key: str, pos: int, want: int) -> tuple[int, bool]:
        """How many bytes to send from `pos` (blocking while stalled); True if the connection must then be cut."""
        with self._cond:
            while True:
                if self._closed:
                    raise _Abort()
                at = self._stall.get(key)
                if at is None or pos < at:
                    break
                self._cond.wait(0.5)
            n = want if at is None else min(want, at - pos)
            cut = False
            plan = self._disconnect.get(key)
            if plan and plan[1] > 0 and pos + n >= plan[0]:
                n, cut = max(0, plan[0] - pos), True
                plan[1] -= 1
            rate = self._throttle.get(key)
        if rate:
            n = min(n, max(1, int(rate / 20)))
        return n, cut

    def _sent(self, key: str, n: int) -> None:
        with self._cond:
            self.bytes_served[key] += n
            self._cond.notify_all()

    def _throttle_sleep(self, key: str, n: int) -> None:
        with self._cond:
            rate = self._throttle.get(key)
        if rate:
            time.sleep(n / rate)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: StandinHub

    def __init__(self, *args, **kwargs):
        self._sockets: set[socket.socket] = set()
        self._sockets_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._sockets_lock:
            self._sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._sockets_lock:
            self._sockets.discard(request)
        super().shutdown_request(request)

    def cut_all(self) -> None:
        with self._sockets_lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def handle_error(self, request, client_address):  # client went away / connection cut on purpose
        pass


def _split_resolve(segments: list[str]) -> tuple[str, str, str, str] | None:
    repo_type = "model"
    if segments and segments[0] in ("datasets", "spaces"):
        repo_type, segments = _REPO_TYPES[segments[0]], segments[1:]
    for n in (2, 1):
        if len(segments) > n + 2 and segments[n] == "resolve":
            return repo_type, "/".join(segments[:n]), segments[n + 1], "/".join(segments[n + 2:])
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format, *args):  # quiet
        pass

    def do_HEAD(self):
        self._dispatch(head=True)

    def do_GET(self):
        self._dispatch(head=False)

    # ---- plumbing ------------------------------------------------------------------------
    def _dispatch(self, head: bool) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        raw = url.path.lstrip("/").split("/")
        segments = [unquote(s) for s in raw]
        resolved = _split_resolve(segments) if segments[0] != "api" else None
        hub._log(self.command, unquote(url.path), self.headers.get("Range"),
                 f"{resolved[1]}/{resolved[3]}" if resolved else None)
        self._head = head
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            failure = hub._wait_or_fail(unquote(url.path))
            if failure is not None:
                return self._error(failure, None, f"injected failure {failure}")
            if segments[:2] == ["api", "agent-harnesses"]:
                return self._json(200, {"standardEnvVars": [], "harnesses": {}})
            if len(segments) >= 3 and segments[0] == "api" and segments[1] in _REPO_TYPES:
                return self._api(_REPO_TYPES[segments[1]], segments[2:], query)
            if resolved:
                return self._resolve(*resolved)
            self._error(404, None, "Not Found")
        except _Abort:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not self._head:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None) -> None:
        self._send(status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})},
                   json.dumps(obj).encode())

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _repo_not_found(self) -> None:
        # Anonymous callers get 401 (the Hub does not reveal whether a private repo exists), others 404.
        self._error(401 if self._bearer() is None else 404, "RepoNotFound", "Repository not found")

    def _commit(self, state: _RepoState, revision: str) -> HubRepo | None:
        sha = state.main if revision == "main" else revision
        return state.commits.get(sha)

    # ---- /api ----------------------------------------------------------------------------
    def _api(self, repo_type: str, rest: list[str], query: dict[str, str]) -> None:
        hub = self.server.hub
        candidates = [n for n in (2, 1) if len(rest) >= n and (len(rest) == n or rest[n] in ("revision", "tree"))]
        if not candidates:
            return self._error(404, None, "Not Found")
        n = next((n for n in candidates if hub._lookup(repo_type, "/".join(rest[:n]))), candidates[0])
        repo_id, tail = "/".join(rest[:n]), rest[n:]
        state = hub._lookup(repo_type, repo_id)
        if state is None:
            return self._repo_not_found()
        revision = tail[1] if len(tail) >= 2 else "main"
        commit = self._commit(state, revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if not tail or tail[0] == "revision":
            return self._json(200, self._info(commit, state, blobs=query.get("blobs", "").lower() == "true"))
        path_in_repo = "/".join(tail[2:]).strip("/")
        recursive = query.get("recursive", "").lower() == "true"
        entries = _tree(commit, path_in_repo, recursive)
        if entries is None:
            return self._error(404, "EntryNotFound", f"{path_in_repo} does not exist on \"{revision}\"")
        cursor = int(query.get("cursor", "0") or 0)
        page = entries[cursor:cursor + hub.page_size]
        headers = {}
        if cursor + hub.page_size < len(entries):
            q = "&".join(f"{k}={quote(v)}" for k, v in {**query, "cursor": str(cursor + hub.page_size)}.items())
            headers["Link"] = f'<{hub.endpoint}{urlsplit(self.path).path}?{q}>; rel="next"'
        self._json(200, page, headers)

    @staticmethod
    def _info(commit: HubRepo, state: _RepoState, blobs: bool) -> dict:
        siblings = []
        for name in sorted(commit.files):
            sibling: dict = {"rfilename": name}
            if blobs:
                sibling.update(_file_entry(name, commit.files[name]))
                sibling.pop("path"), sibling.pop("type")
                sibling["blobId"] = sibling.pop("oid")
                if "lfs" in sibling:
                    lfs = sibling["lfs"]
                    sibling["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
            siblings.append(sibling)
        info = {"_id": commit.sha[:24], "id": commit.repo_id, "author": commit.repo_id.split("/")[0],
                "sha": commit.sha, "lastModified": _DATE, "createdAt": _DATE, "private": False,
                "gated": "auto" if state.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "siblings": siblings,
                "usedStorage": sum(len(d) for d in commit.files.values())}
        if commit.repo_type == "model":
            info["modelId"] = commit.repo_id
        return info

    # ---- /resolve ------------------------------------------------------------------------
    def _resolve(self, repo_type: str, repo_id: str, revision: str, filename: str) -> None:
        hub = self.server.hub
        state = hub._lookup(repo_type, repo_id)
        if state is None:
            return self._repo_not_found()
        commit = self._commit(state, revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if state.gated and self._bearer() != hub.token:
            kind = {"model": "model", "dataset": "dataset", "space": "space"}[repo_type]
            if self._bearer() is None:
                return self._error(401, "GatedRepo", f"Access to {kind} {repo_id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.")
            return self._error(403, "GatedRepo", f"Access to {kind} {repo_id} is restricted and you are not in "
                               f"the authorized list. Visit {hub.endpoint}/{_URL_PREFIX[repo_type]}{repo_id} to "
                               "ask for access.")
        if filename not in commit.files:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit.sha})
        key = f"{repo_id}/{filename}"
        original = commit.files[filename]
        size = len(original)
        etag = commit.etag(filename)
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", "ETag": f'"{etag}"',
                   "X-Repo-Commit": commit.sha,
                   "Content-Disposition": f"inline; filename*=UTF-8''{quote(filename.split('/')[-1])}"}
        if is_lfs(filename):
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
        start, end, status = 0, size, 200
        range_header = self.headers.get("Range")
        if range_header:
            parsed = _parse_range(range_header, size)
            if parsed == "unsatisfiable":
                return self._send(416, {**headers, "Content-Range": f"bytes */{size}"})
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        self._send(status, headers)
        if self._head:
            return
        data = hub._body(key, original)
        pos = start
        while pos < end:
            n, cut = hub._next_chunk(key, pos, min(_CHUNK, end - pos))
            if n:
                self.wfile.write(data[pos:pos + n])
                hub._sent(key, n)
                pos += n
                hub._throttle_sleep(key, n)
            if cut:
                raise _Abort()


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """[start, end) of a single `bytes=` range; None to ignore the header (serve 200); "unsatisfiable" -> 416."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(0, size - n), size) if n > 0 and size > 0 else "unsatisfiable"
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
    except ValueError:
        return None
    if start >= size or end <= start:
        return "unsatisfiable"
    return start, end


def _file_entry(name: str, data: bytes) -> dict:
    if is_lfs(name):
        pointer = lfs_pointer(data)
        return {"type": "file", "oid": git_blob_sha1(pointer), "size": len(data), "path": name,
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}}
    return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}


def _tree(commit: HubRepo, path_in_repo: str, recursive: bool) -> list[dict] | None:
    """Entries under `path_in_repo` (direct children, or all descendants if recursive); None if no such folder."""
    prefix = f"{path_in_repo}/" if path_in_repo else ""
    files = {name: data for name, data in commit.files.items() if name.startswith(prefix)}
    if path_in_repo and not files:
        return None
    dirs: set[str] = set()
    entries = []
    for name in sorted(files):
        rel_parts = name[len(prefix):].split("/")
        for i in range(1, len(rel_parts)):
            dirs.add(prefix + "/".join(rel_parts[:i]))
        if recursive or len(rel_parts) == 1:
            entries.append(_file_entry(name, files[name]))
    for d in sorted(dirs):
        if recursive or "/" not in d[len(prefix):]:
            oid = hashlib.sha1(f"tree\0{commit.sha}\0{d}".encode()).hexdigest()
            entries.append({"type": "directory", "oid": oid, "size": 0, "path": d})
    return sorted(entries, key=lambda e: e["path"])


__all__ = ["HubRepo", "LoggedRequest", "StandinHub", "git_blob_sha1", "hub_online", "is_lfs", "lfs_pointer"]


@contextlib.contextmanager
def hub_online() -> Iterator[None]:
    """Let THIS process's huggingface_hub make requests for a block, although tests/conftest.py made it offline.

    Flips `huggingface_hub.constants.HF_HUB_OFFLINE` (a config value; nothing on the request path is patched).
    First, while still offline, builds one set of headers: that resolves the library's once-per-process
    "agent harness" registry from the local cache (or as empty) instead of fetching it from `constants.ENDPOINT`,
    which in-process is still https://huggingface.co, so no test ever reaches the real Hub.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        build_hf_headers(token=False)
        constants.HF_HUB_OFFLINE = False
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous
