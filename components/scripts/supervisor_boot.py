# The main process of every node's container (`python3 -u -c <this> PARAMS_JSON`): it runs the
# supervisor (components/scripts/supervisor.py) that the `<node>-supervisor` step installed in this
# container, waiting for it on the container's first start. The supervisor's source is not part of
# the container's definition, so a new version of this program does not replace the containers (and
# reload the models): the step writes the new supervisor into the running container, and it takes
# effect the next time the container's main process starts (a crash, `docker restart`, a reboot).
# Kept small and unchanging on purpose: an edit here does replace every node container.
import os
import time

PATH = "/opt/spark-vllm/supervisor.py"
waited = 0
while not os.path.exists(PATH):
    if waited % 30 == 0:
        print(f"[spark-vllm] waiting for the supervisor ({PATH}) that `pulumi up` installs", flush=True)
    time.sleep(1)
    waited += 1
with open(PATH) as handle:
    code = compile(handle.read(), PATH, "exec")
exec(code, {"__name__": "__main__", "__file__": PATH})
