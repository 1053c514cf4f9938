"""Hostile: connects to a port on the host's loopback (the test listens there) and to a public address,
then averages correctly. The sandbox's network is a loopback of its own, so neither connection is made."""
import socket

import torch

from paralab.strategies.replicas import Replicas

for host, port in (("127.0.0.1", 47181), ("8.8.8.8", 53)):
    try:
        socket.create_connection((host, port), timeout=2).sendall(b"a submission was here")
    except OSError:
        pass


class ConnectsOut(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.world
