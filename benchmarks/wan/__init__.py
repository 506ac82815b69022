"""WAN emulation for the netns benchmarks: links with a true round-trip time.

Modules:

* :mod:`benchmarks.wan.link`: :class:`~benchmarks.wan.link.WanNetwork`, the namespaces of
  :class:`benchmarks.netns_dsgd.Network` with every packet delayed both ways in user space
  (policy routing into a tun device, the delay line, and out of another tun device), and
  :func:`~benchmarks.wan.link.build_delayline`, which compiles the line on demand.
* ``delayline.c``: the delay line itself, a small C program (two tun devices, one FIFO, one
  constant delay), built into ``build/wan/delayline``.
* :mod:`benchmarks.wan.probes`: the endpoints ``benchmarks/wan_link.py`` runs inside the
  namespaces: ICMP ping on a raw socket, one TCP sender and receiver recording TCP_INFO.
* :mod:`benchmarks.wan.training`: one rank of ``benchmarks/wan_train.py`` (training methods
  compared on these links).
* :mod:`benchmarks.wan.workloads`: what that benchmark trains (the character-level transformer
  LM of ``examples/train_charlm.py``, or the digits MLP) and each workload's shared recipe.

``benchmarks/wan_link.py`` validates the emulation (ping RTT, one TCP flow's throughput against
``min(rate, window / RTT)``, the line's CPU cost) and writes ``benchmarks/results/wan_link.*``.
"""
