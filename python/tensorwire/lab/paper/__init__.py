"""The paper's reproduction on PyTorch: its six benchmark models and a small
wide-and-deep one (``models``), their data (``data``), one PS training run as
`tensorwire train` makes it (``runs``; ``launch_env`` under torchrun/mpirun),
the sweeps of Figures 8, 10, 11 and Table 2 (``bench_train``, ``table2``),
the transport floor of a PS step (``floor``) and the plots (``plots``).
They train with the product's tensorwire.torch.ps and split models with
tensorwire.torch.partition. Cheap to import: torch comes with the modules."""
