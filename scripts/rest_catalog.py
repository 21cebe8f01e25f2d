#!/usr/bin/env python3
"""An Iceberg REST catalog server that checks OAuth2 client credentials, for the suite's test of a
refused login: Apache Iceberg's REST catalog server (scripts/iceberg-rest/pom.xml), which runs
the suite's other REST tests, hands a token to any credentials. It serves the REST protocol's
endpoints that a writer and a reader of tables use (config, OAuth2 client-credentials tokens,
namespaces, load, register and commit) over pyiceberg's SqlCatalog on a SQLite file; a failed
requirement or a lost race is answered 409, as the protocol says.

With --credential ID:SECRET every request must carry a bearer token from /v1/oauth/tokens.
Prints "listening on PORT" once it serves."""
import argparse
import json
import secrets
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import (CommitFailedException, NamespaceAlreadyExistsError, NoSuchNamespaceError,
                                  NoSuchTableError, TableAlreadyExistsError)
from pyiceberg.table import CommitTableRequest


class Failure(Exception):
    def __init__(self, code, kind, message):
        super().__init__(message)
        self.code, self.kind, self.message = code, kind, message


def serve(args):
    catalog = SqlCatalog(args.catalog_name, uri=f"sqlite:///{args.catalog}", warehouse=f"file://{args.warehouse}")
    tokens = set()
    # Changes one at a time: pyiceberg's SqlCatalog checks before it writes, so two threads
    # creating one namespace would both pass the check. (A commit is also safe without it: its
    # conditional update settles a race.)
    lock = threading.Lock()
    prefix = [p for p in args.prefix.split("/") if p] if args.prefix else []

    def load(ns, name):
        try:
            return catalog.load_table((ns, name))
        except NoSuchTableError as e:
            raise Failure(404, "NoSuchTableException", str(e))

    def table_result(table):
        return {"metadata-location": table.metadata_location,
                "metadata": json.loads(table.metadata.model_dump_json()), "config": {}}

    def route(method, parts, query, body):
        if parts[:2] == ["v1", "config"] and method == "GET":
            overrides = {"prefix": "/".join(prefix)} if prefix else {}
            return 200, {"defaults": {}, "overrides": overrides}
        if parts[0] != "v1" or parts[1:1 + len(prefix)] != prefix:
            raise Failure(404, "NotFoundException", f"no route {'/'.join(parts)}")
        rest = parts[1 + len(prefix):]
        if rest == ["namespaces"] and method == "POST":
            ns = body["namespace"]
            try:
                with lock:
                    catalog.create_namespace(tuple(ns), body.get("properties") or {})
            except NamespaceAlreadyExistsError as e:
                raise Failure(409, "AlreadyExistsException", str(e))
            return 200, {"namespace": ns, "properties": body.get("properties") or {}}
        if len(rest) == 2 and rest[0] == "namespaces" and method in ("GET", "HEAD"):
            try:
                return 200, {"namespace": [rest[1]], "properties": catalog.load_namespace_properties(rest[1])}
            except NoSuchNamespaceError as e:
                raise Failure(404, "NoSuchNamespaceException", str(e))
        if len(rest) == 3 and rest[0] == "namespaces" and rest[2] == "register" and method == "POST":
            try:
                with lock:
                    table = catalog.register_table((rest[1], body["name"]), body["metadata-location"])
            except TableAlreadyExistsError as e:
                raise Failure(409, "AlreadyExistsException", str(e))
            return 200, table_result(table)
        if len(rest) == 4 and rest[0] == "namespaces" and rest[2] == "tables":
            ns, name = rest[1], rest[3]
            if method in ("GET", "HEAD"):
                return 200, table_result(load(ns, name))
            if method == "POST":
                body = dict(body)
                body["identifier"] = {"namespace": [ns], "name": name}
                request = CommitTableRequest.model_validate(body)
                with lock:
                    try:
                        response = catalog.commit_table(load(ns, name), request.requirements, request.updates)
                    except CommitFailedException as e:
                        sys.stderr.write(f"commit to {ns}.{name} refused: {e}\n")
                        raise Failure(409, "CommitFailedException", str(e))
                return 200, json.loads(response.model_dump_json())
        raise Failure(404, "NotFoundException", f"no route {method} {'/'.join(parts)}")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            if args.verbose:
                sys.stderr.write(fmt % a + "\n")

        def reply(self, code, doc):
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def handle_any(self):
            url = urllib.parse.urlsplit(self.path)
            parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if parts == ["v1", "oauth", "tokens"] and self.command == "POST":
                form = dict(urllib.parse.parse_qsl(raw.decode()))
                if args.credential and f"{form.get('client_id')}:{form.get('client_secret')}" != args.credential:
                    return self.reply(401, {"error": "invalid_client", "error_description": "unknown client or wrong secret"})
                token = secrets.token_hex(16)
                tokens.add(token)
                return self.reply(200, {"access_token": token, "token_type": "bearer", "expires_in": 3600,
                                        "issued_token_type": "urn:ietf:params:oauth:token-type:access_token"})
            if args.credential:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if given not in tokens:
                    return self.reply(401, {"error": {"message": "not authorized: a bearer token from /v1/oauth/tokens is required",
                                                      "type": "NotAuthorizedException", "code": 401}})
            try:
                body = json.loads(raw) if raw else {}
                code, doc = route(self.command, parts, urllib.parse.parse_qs(url.query), body)
            except Failure as f:
                code, doc = f.code, {"error": {"message": f.message, "type": f.kind, "code": f.code}}
            except Exception as e:  # a request the catalog cannot take
                code, doc = 400, {"error": {"message": f"{type(e).__name__}: {e}", "type": "BadRequestException", "code": 400}}
            self.reply(code, doc)

        do_GET = do_POST = do_HEAD = do_DELETE = handle_any

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--catalog", required=True, help="the SQLite file behind the catalog (created when missing)")
    p.add_argument("--catalog-name", default="rest")
    p.add_argument("--warehouse", required=True, help="directory of tables created through the server")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--prefix", help="the prefix /v1/config hands out (paths become /v1/PREFIX/...)")
    p.add_argument("--credential", help="CLIENT_ID:SECRET that /v1/oauth/tokens takes; requests then need a token")
    p.add_argument("--verbose", action="store_true")
    serve(p.parse_args())


if __name__ == "__main__":
    main()
