"""Stand-in for the RL routes of sglang/srt/entrypoints/http_server.py (see sglang/__init__.py):
JSON bodies in, {"success": ..., "message": ...} out, on a loopback HTTP server."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, ContinueGenerationReqInput,
                                           EndWeightUpdateReqInput, PauseGenerationReqInput,
                                           UpdateWeightVersionReqInput)


def launch_server(scheduler, host: str = "127.0.0.1", port: int = 0):
    """Serves `scheduler`; returns (server, base url). server.shutdown() stops it."""

    def post(route, body):
        with scheduler.lock:
            if route == "/pause_generation":
                scheduler.pause_generation(PauseGenerationReqInput(**body).mode)
            elif route == "/continue_generation":
                ContinueGenerationReqInput(**body)
                scheduler.continue_generation()
            elif route == "/begin_weight_update":
                scheduler.begin_weight_update(BeginWeightUpdateReqInput(**body).selector)
            elif route == "/end_weight_update":
                EndWeightUpdateReqInput(**body)
                scheduler.end_weight_update()
            elif route == "/update_weight_version":
                req = UpdateWeightVersionReqInput(**body)
                scheduler.weight_version = req.new_version
                return {"success": True, "message": f"Weight version updated to {req.new_version}",
                        "new_version": req.new_version}
            elif route == "/flush_cache":
                return {"success": scheduler.flush_cache()}
            elif route == "/generate":
                return {"output_ids": scheduler.generate(body["input_ids"], body["max_new_tokens"])}
            else:
                return None
        return {"success": True, "message": "Success"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/get_weight_version":
                return self._reply(200, {"weight_version": scheduler.weight_version})
            self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                out = post(self.path, body)
            except (AssertionError, TypeError, ValueError, RuntimeError) as e:
                return self._reply(400, {"success": False, "message": str(e)})
            if out is None:
                return self._reply(404, {"detail": "Not Found"})
            self._reply(200, out)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"
