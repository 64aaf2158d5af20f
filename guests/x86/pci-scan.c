/*
 * pci-scan: lists every function on PCI bus 0 (configuration through
 * ports 0xCF8/0xCFC): "pci BB:DD.F vendor:device class=CC.SS.PP" with the
 * BARs (base, size) and capability ids; then "pci-scan: N functions".
 * Exit 0 (1 if nothing answers).
 */
#include "libcflat.h"
#include "pci.h"

int main(void)
{
	struct pci_dev devs[64];
	int n = pci_scan(devs, 64);
	for (int i = 0; i < n; i++) {
		struct pci_dev *d = &devs[i];
		printf("pci %02x:%02x.%x %04x:%04x class=%02x.%02x.%02x hdr=%#x", d->bdf >> 8,
		       (d->bdf >> 3) & 31, d->bdf & 7, d->vendor, d->device, d->class_code,
		       d->subclass, d->prog_if, d->header_type);
		for (int b = 0; b < 6; b++) {
			if (!d->bar[b] && !pci_bar_size(d, b))
				goto next;
			printf(" bar%d=%s%#lx/%#lx", b, d->bar_io[b] ? "io:" : "", d->bar[b],
			       pci_bar_size(d, b));
		next:
			if (d->bar_64[b])
				b++;
		}
		printf(" caps=");
		u8 p = 0;
		int guard = 0;
		if (pci_cfg_read16(d->bdf, PCI_STATUS) & PCI_STATUS_CAP_LIST)
			for (p = pci_cfg_read8(d->bdf, PCI_CAP_PTR); p >= 0x40 && guard++ < 48;
			     p = pci_cfg_read8(d->bdf, p + 1))
				printf("%02x@%02x,", pci_cfg_read8(d->bdf, p), p);
		printf(" cmd=%#x\n", pci_cfg_read16(d->bdf, PCI_COMMAND));
	}
	printf("pci-scan: %d functions (%s)\n", n, pci_cfg_mechanism());
	return n ? 0 : 1;
}
