"""Many engine replicas behind one OpenAI endpoint, on Ray Serve: each replica runs the single-process
server's app, an ingress forwards every request to the replica a prefix-affinity router picks."""
