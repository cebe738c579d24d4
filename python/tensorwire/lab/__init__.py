"""The lab: what measures tensorwire and reproduces the paper, beside the
product (the device API, tensorwire.ranks, tensorwire.torch and the
`tensorwire` command's entry, tensorwire.cli).

``fabric/``       the fabric benchmark suite (`tensorwire bench` p2p, tensor,
                  write_bw..., fullmesh, alltoall/allreduce, terasort,
                  report); ``fabric/perftest/`` its perftest-style
                  point-to-point tests, ``fabric/tensor/`` the tensor transports
                  compared
``paper/``        the paper's reproduction: its models and data, the PS
                  training runs and sweeps (`tensorwire train`, `bench train`),
                  the transport floor, Table 2, the plots
``torch_dist/``   `tensorwire bench torch-dist`: the torch.distributed backend
                  against gloo (``rank.py`` its ranks)
``conformance/``  PyTorch's own distributed test suite against a backend
``testbed/``      emulated fabrics in network namespaces (`tensorwire testbed`)
``commands/``     the lab's subcommands of `tensorwire`, and ``demo.py``
                  (`tensorwire demo`)

The arrow points one way: the lab imports the product, the product never
imports the lab (tests/python/project/test_layers.py), save tensorwire.cli looking up
``tensorwire.lab.commands`` by name to register the lab's subcommands
(docs/architecture.md §4.1).
"""
