# One chat completion in OpenAI's shape, as a client sends it: what the smoke test, the validation's answers and
# the router's smoke share (each imports it). Standard library only.
import http.client
import io
import json
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request


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
    url = urllib.parse.urlsplit(base_url)
    connection = VerifiedHttps(url.netloc, tls[0], tls[1], timeout)
    try:
        connection.request("POST", url.path + "/v1/chat/completions", body=data,
                           headers={**headers, "Host": f"{tls[0]}:{url.port or 443}"})  # fmt: skip
        response = connection.getresponse()
        text = response.read()
        if response.status >= 300:
            raise urllib.error.HTTPError(base_url, response.status, response.reason, response.headers, io.BytesIO(text))
        return json.loads(text)
    finally:
        connection.close()
