from prefixkv.cli import main

raise SystemExit(main())
