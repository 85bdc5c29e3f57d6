import sys

from pdserve.kv.shipper.process import main

sys.exit(main())
