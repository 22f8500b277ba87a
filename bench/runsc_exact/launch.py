"""ipykernel without its IOPub pipe (bench/runsc_exact/bridge.py starts it).

The pipe is a ZMQ socket on loopback TCP that forked children write their
output through; gVisor refused to checkpoint ipykernel with it
(`endpoint still has waiters upon save`, docs/hibernation.md)."""
import ipykernel.iostream as iostream
from ipykernel.kernelapp import IPKernelApp

_init = iostream.IOPubThread.__init__


def _init_without_pipe(self, socket, pipe=False):
    _init(self, socket, pipe=False)


iostream.IOPubThread.__init__ = _init_without_pipe
IPKernelApp.launch_instance()
