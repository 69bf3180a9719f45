from chimera.cli import main

raise SystemExit(main())
