"""The transport floor of one parameter-server step (tcp: plain sockets; shm:
one memcpy per byte into shared memory): a standalone entry to
tensorwire.lab.paper.floor (its doc says what is measured).

    python3 bench/micro/ps_floor.py --model fcn5 [--transport shm] [--batch 1] [--colocate] [--steps 20]
"""
from tensorwire.lab.paper.floor import main

if __name__ == "__main__":
    main()
