"""Command-line tools around the daemon; the daemon itself never imports them.

- ``ctl``: ``decentctl`` (status, topology, certs, timeline); ``cluster_table``: its cluster
  table; ``timeline_plot``: timelines drawn or merged.
- ``launcher``: ``decentrun``, a local cluster in one command.
"""
