"""Starting and watching processes: local ranks, multi-node jobs, network namespaces."""
