# One chat completion in OpenAI's shape, as a client sends it: what the smoke test, the validation's answers and
# the router's smoke share (each imports it); and the endpoint's /health waited for, which the smoke tests through
# the edge do first. Standard library only.
import http.client
import io
import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request

from components.scripts.node_timing import polls


class VerifiedHttps(http.client.HTTPSConnection):
    """HTTPS to the address of a URL, the certificate verified for `server_name` (the name clients reach the
    endpoint at, which the node itself may not resolve) with the CA `ca` (PEM): what a client checks, no less."""

    def __init__(self, host, server_name, ca, timeout):
        context = ssl.create_default_context(cadata=ca)
        super().__init__(host, timeout=timeout, context=context)
        self.server_name = server_name

    def connect(self):
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.server_name)


def chat(base_url, body, api_key, timeout, tls=None):
    """POST `body` to base_url/v1/chat/completions, with the API key when there is one: the answer's JSON.
    `tls` (server_name, ca PEM): base_url is https:// and its certificate must be for server_name, from ca.
    urllib's HTTPError (an answer other than 2xx), OSError (no answer, a certificate refused) and ValueError (no
    JSON) reach the caller."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if tls is None:
        request = urllib.request.Request(base_url + "/v1/chat/completions", data=data, method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    response, text = _verified(base_url, tls, timeout, "POST", "/v1/chat/completions", data, headers)
    if response.status >= 300:
        raise urllib.error.HTTPError(base_url, response.status, response.reason, response.headers, io.BytesIO(text))
    return json.loads(text)


def _verified(base_url, tls, timeout, method, path, body=None, headers=None):
    """One request over HTTPS to base_url's address, verified as VerifiedHttps does, with the Host a client of
    tls[0] sends: (the response, its body)."""
    url = urllib.parse.urlsplit(base_url)
    connection = VerifiedHttps(url.netloc, tls[0], tls[1], timeout)
    try:
        connection.request(method, url.path + path, body=body,
                           headers={**(headers or {}), "Host": f"{tls[0]}:{url.port or 443}"})  # fmt: skip
        response = connection.getresponse()
        return response, response.read()
    finally:
        connection.close()


def health(base_url, timeout, tls=None):
    """GET base_url/health with no key (the edge answers it without one): the status. `tls` as chat's. OSError (no
    answer, a certificate refused) reaches the caller."""
    if tls is not None:
        return _verified(base_url, tls, timeout, "GET", "/health")[0].status
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_served(base_url, seconds, tls=None, every=0.5):
    """Until base_url/health answers 200, at most `seconds`: None once it does, else what it last answered. The edge
    answers /health from its last check of what it is in front of, which lags a vLLM that just became ready, or an
    edge just reloaded, by up to a check interval (components/plan/edge.py CHECK): a request sent through it at once
    can meet its 503 (CI of af08edc). No answer is waited out as a 503 is; a certificate refused is final
    (ssl.SSLCertVerificationError reaches the caller)."""
    last = "no answer"
    for _ in polls(seconds, every):
        try:
            status = health(base_url, min(5.0, seconds), tls)
        except ssl.SSLCertVerificationError:
            raise
        except OSError as error:
            last = f"no answer ({error})"
            continue
        if status == 200:
            return None
        last = f"HTTP {status}"
    return last
