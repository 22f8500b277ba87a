"""A jupyter_client kernel provisioner that takes its kernel from a running
`cellblock serve` instead of starting a process.

A kernelspec names it in its metadata:

    {"argv": ["cellblock-provisioned"], "display_name": "Python 3 (cellblock server)",
     "language": "python", "interrupt_mode": "message",
     "metadata": {"kernel_provisioner": {
         "provisioner_name": "cellblock-provisioner",
         "config": {"server_file": "/var/lib/cellblock/server.json",
                    "image": "host", "limits": {"exec_timeout_s": 600}}}}}

(`cellblock kernelspec install --provisioner` writes one.) Starting the
kernel is a session_create_request on the server's manager socket: a warm
sandbox from the pool, with the server's policy and audit. The frontend
connects to the session's channels as to any kernel. Shutdown and kill close
the session; a restart closes it and creates another. The session's end by
the server's policy (a timeout, a kill, the idle timeout) is the "process"
exiting: poll() returns its code, and jupyter_client's restarter starts a
new session.
"""
import asyncio
import signal

from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from traitlets import Dict, Float, Unicode

from . import client
from .errors import ClientTimeout, NoSuchSession, SessionClosed

#: close reasons after which the kernel was lost, as `cellblock kernel`'s exit code 1
_LOST = ("kernel_died", "memory_limit", "exec_timeout", "interrupt_ignored")


def exit_code_for(close_reason):
    """The exit code `cellblock kernel` would have for a session closed for this reason."""
    return 1 if close_reason.startswith(_LOST) else 0


class CellblockProvisioner(KernelProvisionerBase):
    """Kernels are sessions of a running `cellblock serve`."""

    server_file = Unicode("", config=True,
                          help="the server's server.json (default: $CELLBLOCK_SERVER_FILE, "
                               "else STATE_DIR/server.json)")
    state_dir = Unicode("", config=True,
                        help="the server's state dir (default $CELLBLOCK_STATE_DIR, "
                             "/var/lib/cellblock)")
    image = Unicode("", config=True, help="image of the session (default: the server's)")
    limits = Dict(config=True, help="session limits, as in session_create_request")
    metadata = Dict(config=True, help="kept with the session in the server's registry")
    create_timeout = Float(120.0, config=True, help="seconds to wait for a session")

    _server = None
    _session_id = None
    _exit_code = None
    #: whether the last kernel came from the server's warm pool
    started_warm = None

    # -- the manager, off the event loop (a cold start can take seconds)
    def _connect(self):
        if self._server is None:
            self._server = client.connect(state_dir=self.state_dir or None,
                                          path=self.server_file or None)
        return self._server

    async def _call(self, msg_type, content, timeout=60.0):
        def call():
            return self._connect().request(msg_type, content, timeout=timeout)[0]
        return await asyncio.get_running_loop().run_in_executor(None, call)

    @property
    def has_process(self):
        return self._session_id is not None

    @property
    def returncode(self):
        """As subprocess.Popen's: None while the session is open (as last polled)."""
        return self._exit_code

    async def pre_launch(self, **kwargs):
        kwargs.pop("extra_arguments", None)
        # No process is started: the kernelspec's argv is not run.
        return await super().pre_launch(cmd=list(self.kernel_spec.argv), **kwargs)

    async def launch_kernel(self, cmd, **kwargs):
        content = {"limits": dict(self.limits),
                   "metadata": {"kernel_id": self.kernel_id, "provisioner": "cellblock-provisioner",
                                **self.metadata}}
        if self.image:
            content["image"] = self.image
        reply = await self._call("session_create_request", content, timeout=self.create_timeout)
        self._session_id = reply["session_id"]
        self._exit_code = None
        self.started_warm = bool(reply.get("warm"))
        info = dict(reply["connection"])
        info["key"] = info["key"].encode()
        self.connection_info = info
        self.log.info("cellblock session %s for kernel %s (%s)", self._session_id, self.kernel_id,
                      "warm" if self.started_warm else "cold start")
        return info

    async def poll(self):
        if self._exit_code is not None or self._session_id is None:
            return self._exit_code
        try:
            info = await self._call("session_info_request", {"session_id": self._session_id},
                                    timeout=10.0)
        except ClientTimeout:
            return None  # a busy server is not a dead kernel
        except NoSuchSession:
            self._exit_code = 1
            return self._exit_code
        if info.get("state") == "closed":
            self._exit_code = exit_code_for(info.get("close_reason", ""))
            self.log.info("cellblock session %s closed: %s", self._session_id,
                          info.get("close_reason", ""))
        return self._exit_code

    async def wait(self):
        while await self.poll() is None:
            await asyncio.sleep(0.1)
        return self._exit_code

    async def _close_session(self, exit_code):
        if self._session_id is None or self._exit_code is not None:
            return
        try:
            await self._call("session_close_request", {"session_id": self._session_id})
        except (NoSuchSession, SessionClosed):
            pass
        self._exit_code = exit_code

    async def send_signal(self, signum):
        if signum == 0:
            return
        if signum == signal.SIGINT:
            await self._interrupt()
            return
        await self._close_session(-signum)

    async def _interrupt(self):
        """An interrupt_request on the session's control channel (the server
        interrupts the kernel, and escalates if the code ignores it)."""
        import zmq
        from jupyter_client.session import Session as WireSession
        info = self.connection_info

        def send():
            wire = WireSession(key=info["key"], signature_scheme=info["signature_scheme"],
                               username="cellblock-provisioner")
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 1000
            try:
                sock.connect(f"{info['transport']}://{info['ip']}:{info['control_port']}")
                wire.send(sock, "interrupt_request", {})
                if sock.poll(10000):  # the interrupt_reply, off the event loop
                    sock.recv_multipart()
            finally:
                sock.close()
        await asyncio.get_running_loop().run_in_executor(None, send)

    async def kill(self, restart=False):
        await self._close_session(-signal.SIGKILL)

    async def terminate(self, restart=False):
        await self._close_session(-signal.SIGTERM)

    async def cleanup(self, restart=False):
        self._session_id = None
        if not restart and self._server is not None:
            server, self._server = self._server, None
            server.close()

    def get_shutdown_wait_time(self, recommended=5.0):
        # The server answers a shutdown_request itself after 3 s without the kernel's reply.
        return max(recommended, 8.0)

    async def get_provisioner_info(self):
        info = await super().get_provisioner_info()
        info.update({"session_id": self._session_id, "server_file": self.server_file,
                     "state_dir": self.state_dir})
        return info

    async def load_provisioner_info(self, provisioner_info):
        await super().load_provisioner_info(provisioner_info)
        self._session_id = provisioner_info.get("session_id")
        self.server_file = provisioner_info.get("server_file", "")
        self.state_dir = provisioner_info.get("state_dir", "")
