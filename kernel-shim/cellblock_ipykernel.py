"""Starts ipykernel inside a cellblock sandbox.

One upstream race is fixed here. After an error, ipykernel 6.17 aborts queued
execute requests until a "stop aborting" marker, which it schedules with
call_later(0): a request that becomes readable in the same event-loop turn is
dispatched before the marker and aborted, although the client sent it after
seeing the error's reply and idle status (seen here against a bare ipykernel,
about one time in three). With no stop_on_error_timeout configured, we queue
the marker right after the requests that were already waiting, so only those
are aborted, as the messaging spec intends.
"""
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp


class SandboxKernel(IPythonKernel):
    def _abort_queues(self):
        if self.stop_on_error_timeout or not hasattr(self, "schedule_dispatch"):
            return super()._abort_queues()
        self._aborting = True
        # Move every request already received into the queue, then the marker.
        self.shell_stream.flush()

        async def stop_aborting():
            self._aborting = False

        self.schedule_dispatch(stop_aborting)


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=SandboxKernel)
