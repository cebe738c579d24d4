"""The loopback-TCP floor of one parameter-server step: a standalone entry to
tensorwire.torch.tcp_floor (its doc says what is measured).

    python3 bench/micro/ps_tcp_floor.py --model fcn5 [--batch 1] [--colocate] [--steps 20]
"""
from tensorwire.torch.tcp_floor import main

if __name__ == "__main__":
    main()
