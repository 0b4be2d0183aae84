# The endpoint's /health waited for: what a step that asks through the edge (the endpoint's smoke test, the router's)
# does first. The edge answers /health from its last check of what it is in front of, which lags a vLLM that just
# became ready, or an edge just reloaded, by up to a check interval (components/plan/edge.py CHECK): a request sent
# through it at once can meet its 503 (CI of af08edc). Standard library only.
import ssl
import urllib.error
import urllib.parse
import urllib.request

from components.scripts.node_chat import VerifiedHttps
from components.scripts.node_timing import polls


def health(base_url, timeout, tls=None):
    """GET base_url/health with no key (the edge answers it without one): the status. `tls` (server_name, ca PEM) as
    node_chat.chat's. OSError (no answer, a certificate refused) reaches the caller."""
    if tls is None:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=timeout) as response:
                response.read()
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
    url = urllib.parse.urlsplit(base_url)
    connection = VerifiedHttps(url.netloc, tls[0], tls[1], timeout)
    try:
        connection.request("GET", url.path + "/health", headers={"Host": f"{tls[0]}:{url.port or 443}"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def wait_served(base_url, seconds, tls=None, every=0.5):
    """Until base_url/health answers 200, at most `seconds`: None once it does, else what it last answered. No answer
    is waited out as a 503 is; a certificate refused is final (ssl.SSLCertVerificationError reaches the caller)."""
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
