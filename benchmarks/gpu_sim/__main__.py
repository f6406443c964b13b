from benchmarks.gpu_sim.server import main

raise SystemExit(main())
