"""The gRPC service beside the HTTP server (`tessellm serve --grpc-port PORT`).

tessellm.proto (shipped in the package) is the contract; tessellm_pb2.py is generated from it
by grpcio-tools and committed (tests/server/test_grpc_proto.py checks it is up to date).
Modules: status (HTTP statuses and errors -> gRPC status codes, the API-key check),
messages (GenerateRequest -> the /v1/completions schema), service (the four methods and
their handler table), server (start-up on the server's event loop), client (a typed stub).
Nothing here is imported unless --grpc-port is given: grpcio is the optional extra
`tessellm[grpc]`.
"""
