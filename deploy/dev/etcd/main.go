// A few-line etcd server for the operator's tests: one member on loopback, data in --data-dir.
package main

import (
	"flag"
	"log"
	"net/url"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dataDir := flag.String("data-dir", "default.etcd", "directory for the member's data")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL")
	flag.Parse()

	client, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("--listen-client-urls: %v", err)
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("--listen-peer-urls: %v", err)
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	cfg.LogLevel = "error"

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("starting etcd: %v", err)
	}
	defer server.Close()
	<-server.Server.ReadyNotify()
	log.Printf("etcd ready on %s", client)
	log.Fatal(<-server.Err())
}
